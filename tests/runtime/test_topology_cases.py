"""Every case of ../shared/cases/topology/ (repo root relative; CI has shared/ beside the clone)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mopd_hpc.runtime.topology import RankTopology, TopologyError

CASES_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "cases" / "topology"
CASES = sorted(CASES_DIR.glob("*.json"))


def test_cases_are_present() -> None:
    assert len(CASES) >= 3, f"no topology cases under {CASES_DIR}"


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_case(path: Path) -> None:
    case = json.loads(path.read_text())
    if "error" in case:
        with pytest.raises(TopologyError) as info:
            RankTopology.from_env(case["env"], role=case.get("role"))
        assert case["error"] in str(info.value)
        return
    topo = RankTopology.from_env(case["env"], role=case.get("role"))
    got = topo.to_dict()
    assert {k: got[k] for k in case["expect"]} == case["expect"]
    assert got["role"] == case.get("role")
    assert got["backend"] == "slurm"
    # the JSON form round-trips into an equal record
    assert RankTopology.from_dict(json.loads(json.dumps(got))) == topo
