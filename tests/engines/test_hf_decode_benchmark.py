"""benchmarks/hf_decode.py on CPU (decode-tiny): every row decodes its tokens, and `--profile` records where a
decode step's time goes (ops ranked by self time) in the JSON, as it will on the GPU."""

from __future__ import annotations

import json
from pathlib import Path

import helpers_fork

REPO = Path(__file__).resolve().parents[2]


def test_profile_ranks_the_ops_of_each_decoder(tmp_path: Path) -> None:
    out = tmp_path / "hf_decode.json"
    proc = helpers_fork.run(
        [str(REPO / "benchmarks" / "hf_decode.py"), "--size", "decode-tiny", "--device", "cpu",
         "--runs", "2x4", "--decoders", "loop,static", "--profile", "3", "--threads", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["decoder"], r["rows"], r["new_tokens"]) for r in result["runs"]] == [
        ("loop", 2, 4),
        ("static", 2, 4),
    ]
    assert all(
        r["tokens_per_s"] > 0 and r["seconds"] > 0 for r in result["runs"]
    )  # the script asserts 8 tokens
    for decoder in ("loop", "static"):
        prof = result["profiles"][decoder]
        assert (prof["rows"], prof["steps"]) == (2, 3)
        assert prof["kernel_s"] is None and prof["busy_fraction"] is None  # no device on CPU
        times = [op["self_s"] for op in prof["top"]]
        assert times and times == sorted(times, reverse=True) and times[0] > 0
        assert sum(times) <= prof["wall_s"] * 1.05  # self times on one thread fit in the wall time
        assert any(op["op"] == "aten::mm" or op["op"] == "aten::addmm" for op in prof["top"])
