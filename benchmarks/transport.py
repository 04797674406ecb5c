"""Teacher scoring round trip on loopback, JSON vs binary transport (DESIGN.md §7; goal >= 1 GB/s payload).

A real `TeacherServer` (aiohttp, its own process) over a stand-in engine that returns fixed scores at once
(so that only transport is timed), and the real `TeacherClient` in this process:

- json:   `TeacherClient(binary=False).score`  JSON request, JSON answer, lists of floats
- binary: `TeacherClient.score_tensors`        frame request, frame answer, packed tensors
- bytes:  the answer's byte count as one uint8 tensor through the same `send_frame` / `read_frame`: what
          the transport alone costs on this host (no per-row parts, no dtype conversion, no request)
- socket: the same byte count sent by one `sendall` from a thread of the server process and received by
          `recv_into` into one reused buffer, no HTTP: the loopback ceiling of this host, measured right
          after each binary case (same load); the JSON's `ceiling` gives binary / socket per shape

The production step is 256 rows x 4,096 response tokens (prompts of 512), top-k 64: ~67 M id/value pairs
per teacher. A fraction f sends 256·f rows of that shape. Payload = the answer's information at the binary
dtypes (log-probs f32 + top-k ids i32 + top-k values f32 = 4 + 8·K bytes per response token), the same for
both encodings; payload GB/s = payload / round-trip seconds (request encode → answer decoded, the median
of `--repeats`; `payload_GBps_best` the fastest). Bytes on the wire = request + answer bodies (HTTP
headers excluded). cpu srv / cpu cli = CPU seconds of the server's handler and of the client's call (all threads, kernel time included); cpu-bound
GB/s = payload / the busier side's CPU seconds: the rate when the two sides overlap on cores of their own
(on a shared host the wall clock also counts other processes' turns). Server CPU and seconds are medians
too, read from the server after each timed call.

Binary answers are checked bit for bit against the engine's tensors (rows 0 and B−1 regenerated here),
JSON against binary at the smallest fraction. Each process runs torch with `--threads` threads (default 1:
two processes on a 2-core host). The host's memory copy rates (into fresh and into reused memory) are
measured after the runs, for context: the answer's float32 rows leave the server from the engine's memory
and land in the client's buffer with no copy in user space (the kernel copies twice); its int64 top-k ids
are cast into int32 pieces (one copy).

    .venv/bin/python benchmarks/transport.py [--binary 1/64,1/16,1/4,1] [--json 1/64,1/16] [--repeats 7]

Prints a table and writes benchmarks/results/transport.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
ROWS, RESPONSE, PROMPT, TOP_K, VOCAB = 256, 4096, 512, 64, 151_936
GOAL_GBPS = 1.0
#: The job token of the benchmark's server (every server of a job requires one: runtime/http_auth.py).
TOKEN = "transport-bench"


def fake_row(b: int, width: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row b's scores: (log-probs [T] f32, top-k ids [T, K] i64, top-k log-probs [T, K] f32), seeded by b."""
    g = torch.Generator().manual_seed(1000 + b)
    vals = -torch.rand(width, k, generator=g) * 20
    return vals[:, 0].clone(), torch.randint(0, VOCAB, (width, k), generator=g), vals


class FixedScores:
    """A scoring engine whose answer is fixed per batch shape (`fake_row`), built once and then cached."""

    vocab_size = VOCAB

    def __init__(self) -> None:
        from mopd_hpc.engines.memory.residency import Residency

        self.residency = Residency(torch.nn.Linear(1, 1), torch.device("cpu"))
        self.device = torch.device("cpu")
        self.cache: dict[tuple[int, int, int | None], Any] = {}

    def score(self, batch: Any, k: int | None = None, *, host: bool = True) -> Any:  # CPU: host either way
        from mopd_hpc.mopd.topk import TeacherTopK

        key = (batch.batch_size, batch.response_width, k)
        if key not in self.cache:
            self.cache.clear()
            rows = [fake_row(b, key[1], k or 1) for b in range(key[0])]
            lp = torch.stack([r[0] for r in rows])
            top = TeacherTopK(torch.stack([r[1] for r in rows]), torch.stack([r[2] for r in rows]))
            self.cache[key] = (lp, top if k else None)
        return self.cache[key]


async def serve(port_file: Path) -> None:
    """The server process: TeacherServer over FixedScores, plus GET /sizes (the last /score's body sizes,
    the handler's seconds and this process's peak RSS)."""
    from aiohttp import web

    from mopd_hpc.engines.frames.codec import layout
    from mopd_hpc.engines.frames.over_http import send_frame
    from mopd_hpc.engines.serving import start_app
    from mopd_hpc.engines.teacher.http_app import TeacherServer
    from mopd_hpc.runtime.http_auth import protect

    model = Path(tempfile.mkdtemp(prefix="transport-"))
    (model / "config.json").write_text("{}")
    server = TeacherServer(FixedScores(), "bench", str(model), max_body_bytes=4 << 30)  # type: ignore[arg-type]
    last: dict[str, Any] = {}

    @web.middleware
    async def sizes(request: web.Request, handler: Any) -> web.StreamResponse:
        start, cpu = time.perf_counter(), time.process_time()
        resp = await handler(request)
        if request.path in ("/score", "/bytes"):
            last.update(request_bytes=request.content_length, answer_bytes=resp.content_length,
                        server_s=time.perf_counter() - start, server_cpu_s=time.process_time() - cpu)  # fmt: skip
        return resp

    async def report(request: web.Request) -> web.Response:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return web.json_response(last | {"peak_rss_bytes": peak})

    raw: dict[int, torch.Tensor] = {}

    async def raw_bytes(request: web.Request) -> web.StreamResponse:
        n = int((await request.json())["n"])
        if n not in raw:
            raw.clear()
            raw[n] = torch.randint(0, 256, (n,), dtype=torch.uint8)
        return await send_frame(request, layout({"raw": raw[n]}))

    async def socket_port(request: web.Request) -> web.Response:
        return web.json_response({"port": sink_port})

    sink_port = raw_socket_server()
    app = protect(server.app(), TOKEN)
    app.middlewares.append(sizes)
    app.router.add_get("/sizes", report)
    app.router.add_post("/bytes", raw_bytes)
    app.router.add_get("/socket", socket_port)
    runner, port, stop = await start_app(app, "127.0.0.1", 0)
    port_file.write_text(str(port))
    await stop.wait()
    await runner.cleanup()


def raw_socket_server() -> int:
    """A thread of the server process that answers each 8-byte count n on a plain TCP connection with n
    bytes, one `sendall` of a prebuilt buffer (no HTTP, no framing, no copy in user space): the loopback
    ceiling of this host in the same run. Returns its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    sent: dict[int, memoryview] = {}

    def serve_one(conn: socket.socket) -> None:
        with conn:
            while (ask := conn.recv(8, socket.MSG_WAITALL)) and len(ask) == 8:
                n = int.from_bytes(ask, "little")
                if n not in sent:
                    sent.clear()
                    sent[n] = memoryview(torch.randint(0, 256, (n,), dtype=torch.uint8).numpy())
                conn.sendall(sent[n])

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return int(listener.getsockname()[1])


class RawSocket:
    """The client of `raw_socket_server`: `fetch(n)` receives n bytes into one reused buffer (`recv_into`)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.buffer = memoryview(bytearray())

    def fetch(self, n: int) -> memoryview:
        if self.buffer.nbytes < n:
            self.buffer = memoryview(bytearray(n))
        self.sock.sendall(n.to_bytes(8, "little"))
        pos = 0
        while pos < n:
            got = self.sock.recv_into(self.buffer[pos:n], min(n - pos, 4 << 20))
            if not got:
                raise ConnectionError(f"raw socket closed after {pos} of {n} bytes")
            pos += got
        return self.buffer[:n]


def request_rows(rows: int) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (rows, PROMPT + RESPONSE), generator=g).tolist()
    return ids, [PROMPT] * rows


async def round_trip(url: str, encoding: str, rows: int, repeats: int) -> dict[str, Any]:
    import aiohttp

    from mopd_hpc.engines.frames.buffer_pool import BufferPool
    from mopd_hpc.engines.frames.over_http import read_frame
    from mopd_hpc.engines.teacher.client import TeacherClient
    from mopd_hpc.runtime.http_auth import auth_headers

    ids, starts = request_rows(rows)
    times, cpus, answer = [], [], None
    tokens = rows * RESPONSE
    payload = tokens * (4 + 8 * TOP_K)
    pool = BufferPool(keep=1)  # as TeacherClient's
    async with (
        TeacherClient(url, binary=encoding != "json", token=TOKEN) as client,
        TeacherClient(url, token=TOKEN) as binary,
        aiohttp.ClientSession(headers=auth_headers(TOKEN)) as http,
    ):

        async def raw_bytes(_ids: Any, _starts: Any, _k: int) -> Any:
            n = payload if len(_ids) == rows else 8
            async with http.post(url + "/bytes", json={"n": n}) as resp:
                return await read_frame(resp, pool=pool)

        async with http.get(url + "/socket") as resp:
            sock = RawSocket(int((await resp.json())["port"]))

        async def raw_socket(_ids: Any, _starts: Any, _k: int) -> Any:
            return sock.fetch(payload if len(_ids) == rows else 8)

        calls = {
            "json": client.score,
            "binary": client.score_tensors,
            "bytes": raw_bytes,
            "socket": raw_socket,
        }
        call = calls[encoding]
        await call(ids[:1], starts[:1], TOP_K)  # warm the connection
        build = {"bytes": raw_bytes, "socket": raw_socket}.get(encoding, binary.score_tensors)
        await build(ids, starts, TOP_K)  # the server builds its fixed answer for this shape: not timed
        server: list[dict[str, Any]] = []
        for _ in range(repeats):
            answer = None
            start, cpu = time.perf_counter(), time.process_time()
            answer = await call(ids, starts, TOP_K)
            times.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
            async with http.get(url + "/sizes") as resp:  # after the timed call
                server.append(await resp.json())
    check = verify(answer, rows) if encoding == "binary" else None
    median = statistics.median(times)
    if encoding == "socket":  # no HTTP: the server's handler does not see it
        sizes: dict[str, Any] = {"request_bytes": 8, "answer_bytes": payload, "peak_rss_bytes": None}
        server_s = server_cpu = None
    else:
        sizes = server[-1]
        server_s = statistics.median(x["server_s"] for x in server)
        server_cpu = statistics.median(x["server_cpu_s"] for x in server)
    client_cpu = statistics.median(cpus)
    return {
        "encoding": encoding,
        "rows": rows,
        "fraction": str(Fraction(rows, ROWS)),
        "pairs_millions": tokens * TOP_K / 1e6,
        "seconds": median,
        "seconds_best": min(times),
        "seconds_all": times,
        "server_s": server_s,
        "client_cpu_s": client_cpu,
        "server_cpu_s": server_cpu,
        "request_bytes": sizes["request_bytes"],
        "answer_bytes": sizes["answer_bytes"],
        "wire_bytes": sizes["request_bytes"] + sizes["answer_bytes"],
        "payload_bytes": payload,
        "payload_GBps": payload / median / 1e9,
        "payload_GBps_best": payload / min(times) / 1e9,
        "payload_GBps_cpu_bound": payload / max(client_cpu, server_cpu or 0.0) / 1e9,
        "server_peak_rss_bytes": sizes["peak_rss_bytes"],
        "client_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "bitwise_checked": check,
        "_answer": answer if encoding == "json" and rows == 4 else None,
    }


def verify(answer: Any, rows: int) -> str:
    """Rows 0 and B−1 of a binary answer equal the engine's tensors bit for bit (raises otherwise)."""
    for b in sorted({0, rows - 1}):
        lp, ids, vals = fake_row(b, RESPONSE, TOP_K)
        sl = slice(b * RESPONSE, (b + 1) * RESPONSE)
        assert torch.equal(answer.logprobs[sl].view(torch.int32), lp.view(torch.int32)), b
        assert torch.equal(answer.topk_ids[sl].long(), ids), b
        assert torch.equal(answer.topk_logprobs[sl].view(torch.int32), vals.view(torch.int32)), b
    return f"rows 0 and {rows - 1}"


def memory_rates(nbytes: int = 256 << 20) -> dict[str, float]:
    """GB/s of one copy of `nbytes` into freshly allocated memory and into memory already touched (best of 3)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    reused = torch.empty_like(src)
    fresh = warm = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        torch.empty_like(src).copy_(src)
        fresh = min(fresh, time.perf_counter() - start)
        start = time.perf_counter()
        reused.copy_(src)
        warm = min(warm, time.perf_counter() - start)
    return {"fresh_copy_GBps": nbytes / fresh / 1e9, "warm_copy_GBps": nbytes / warm / 1e9}


def fractions(text: str) -> list[int]:
    out = [int(Fraction(f) * ROWS) for f in text.split(",") if f]
    if any(r < 1 or r > ROWS for r in out):
        raise SystemExit(f"fractions {text!r}: expected values in [1/{ROWS}, 1]")
    return out


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    port_file = Path(tempfile.mkdtemp(prefix="transport-")) / "port"
    env = dict(os.environ) | {"PYTHONPATH": str(REPO)}
    cmd = [sys.executable, __file__, "--serve", str(port_file), "--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO)
    try:
        for _ in range(600):
            if port_file.exists() and port_file.read_text():
                break
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode}")
            await asyncio.sleep(0.1)
        url = f"http://127.0.0.1:{port_file.read_text()}"
        out = []
        cases = [("json", r, args.json_repeats) for r in fractions(args.json)]  # first: peak RSS is JSON's
        for r in fractions(args.binary):  # each binary case next to the ceiling at its size (same load)
            cases += [("binary", r, args.repeats), ("socket", r, args.repeats)]
        cases += [("bytes", r, args.repeats) for r in fractions(args.bytes)]
        for encoding, rows, repeats in cases:
            out.append(await round_trip(url, encoding, rows, repeats))
            print(json.dumps({k: v for k, v in out[-1].items() if not k.startswith("_")}), flush=True)
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def equal_at_smallest(url_rows: list[dict[str, Any]]) -> bool | None:
    """JSON's lists, as float32 / int tensors, equal the binary answer bit for bit (fraction 1/64)."""
    js = next((r["_answer"] for r in url_rows if r["_answer"] is not None), None)
    if js is None:
        return None
    ids, vals = [], []
    for b in range(4):
        lp, i, v = fake_row(b, RESPONSE, TOP_K)
        ids.append(i)
        vals.append(v)
        assert torch.equal(
            torch.tensor(js.logprobs[b], dtype=torch.float32).view(torch.int32), lp.view(torch.int32)
        )
    assert torch.equal(torch.tensor(js.topk_ids), torch.stack(ids))
    got = torch.tensor(js.topk_logprobs, dtype=torch.float32)
    return torch.equal(got.view(torch.int32), torch.stack(vals).view(torch.int32))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--binary", default="1/64,1/16,1/4,1", help="fractions of the production step, binary")
    p.add_argument("--json", default="1/64,1/16", help="fractions of the production step, JSON")
    p.add_argument("--bytes", default="1/4,1", help="fractions of the production step, transport alone")
    p.add_argument(
        "--repeats", type=int, default=7, help="timed round trips per binary case (median is kept)"
    )
    p.add_argument("--json-repeats", type=int, default=1, help="timed round trips per JSON case")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each process (server, client)")
    p.add_argument("--out", type=Path, default=RESULTS / "transport.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.serve:
        asyncio.run(serve(args.serve))
        return 0
    sys.path.insert(0, str(REPO / "benchmarks"))
    from results_file import write_results

    load_start = os.getloadavg()[0]
    rows = asyncio.run(run(args))
    memory = memory_rates()  # after the runs: peak RSS (which a child inherits at exec) stays the runs' own
    print(f"host memory copy: {memory['fresh_copy_GBps']:.2f} GB/s into fresh memory, "
          f"{memory['warm_copy_GBps']:.2f} GB/s into reused memory (256 MB, one thread)")  # fmt: skip
    json_equal = equal_at_smallest(rows)
    print(f"\n{'encoding':8} {'fraction':>8} {'rows':>5} {'pairs M':>8} {'seconds':>8} {'cpu srv':>8} "
          f"{'cpu cli':>8} {'wire MB':>9} {'payload MB':>10} {'payload GB/s':>12} {'cpu-bound GB/s':>14}")  # fmt: skip
    for r in rows:
        print(f"{r['encoding']:8} {r['fraction']:>8} {r['rows']:>5} {r['pairs_millions']:>8.1f} "
              f"{r['seconds']:>8.3f} {r['server_cpu_s'] or float('nan'):>8.3f} {r['client_cpu_s']:>8.3f} "
              f"{r['wire_bytes'] / 1e6:>9.1f} {r['payload_bytes'] / 1e6:>10.1f} {r['payload_GBps']:>12.3f} "
              f"{r['payload_GBps_cpu_bound']:>14.3f}")  # fmt: skip
    scaling = {}
    for enc in ("binary", "json"):
        mine = sorted((r for r in rows if r["encoding"] == enc), key=lambda r: r["rows"])
        if mine:
            big = mine[-1]
            scaling[enc] = {
                "from_fraction": big["fraction"],
                "seconds_per_million_pairs": big["seconds"] / big["pairs_millions"],
                "wire_bytes_per_pair": big["wire_bytes"] / (big["pairs_millions"] * 1e6),
                "full_step_seconds_linear": big["seconds"] * ROWS / big["rows"],
                "full_step_wire_bytes_linear": big["wire_bytes"] * ROWS / big["rows"],
            }
            if enc == "json" and len(mine) > 1:  # peak RSS grows by a fixed amount per pair: extrapolate
                small, pairs = mine[0], (big["pairs_millions"] - mine[0]["pairs_millions"]) * 1e6
                for side in ("server", "client"):
                    per_pair = (big[f"{side}_peak_rss_bytes"] - small[f"{side}_peak_rss_bytes"]) / pairs
                    scaling[enc][f"{side}_rss_bytes_per_pair"] = per_pair
                    scaling[enc][f"full_step_{side}_rss_bytes_linear"] = per_pair * ROWS * RESPONSE * TOP_K
    binary_best = max((r["payload_GBps"] for r in rows if r["encoding"] == "binary"), default=0.0)
    binary_cpu = max((r["payload_GBps_cpu_bound"] for r in rows if r["encoding"] == "binary"), default=0.0)
    ceiling = {}
    for r in rows:
        if r["encoding"] == "binary":
            sock = next((c for c in rows if c["encoding"] == "socket" and c["rows"] == r["rows"]), None)
            if sock is not None:
                ceiling[r["fraction"]] = {
                    "binary_payload_GBps": r["payload_GBps"],
                    "socket_GBps": sock["payload_GBps"],
                    "ratio": r["payload_GBps"] / sock["payload_GBps"],
                }
    for frac, c in ceiling.items():
        print(f"{frac:>5}: binary {c['binary_payload_GBps']:.3f} GB/s = {c['ratio']:.0%} of a raw socket's "
              f"{c['socket_GBps']:.3f} GB/s (median of the same run)")  # fmt: skip
    for enc, s in scaling.items():
        print(f"{enc}: {s['seconds_per_million_pairs']:.3f} s per M pairs, {s['wire_bytes_per_pair']:.1f} wire "
              f"bytes per pair -> full step ~{s['full_step_seconds_linear']:.1f} s, "
              f"{s['full_step_wire_bytes_linear'] / 1e9:.2f} GB (linear from {s['from_fraction']})")  # fmt: skip
    if "full_step_server_rss_bytes_linear" in scaling.get("json", {}):
        j = scaling["json"]
        print(f"json at the full step would need ~{j['full_step_server_rss_bytes_linear'] / 2**30:.1f} GiB "
              f"(server) + ~{j['full_step_client_rss_bytes_linear'] / 2**30:.1f} GiB (client) of memory")  # fmt: skip
    print(f"JSON == binary bit for bit at 1/64: {json_equal}")
    print(f"goal binary >= {GOAL_GBPS} GB/s payload: {'met' if binary_best >= GOAL_GBPS else 'NOT met'} "
          f"(best shape {binary_best:.2f} GB/s wall clock, median of {args.repeats}; {binary_cpu:.2f} GB/s CPU-bound)")  # fmt: skip
    result = {
        "benchmark": "transport",
        "shape": {
            "rows": ROWS,
            "response_tokens": RESPONSE,
            "prompt_tokens": PROMPT,
            "top_k": TOP_K,
            "vocab": VOCAB,
        },
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads_per_process": args.threads,
            "load_average_1m_start": load_start,
            "load_average_1m_end": os.getloadavg()[0],
        },
        "host_memory": memory,
        "goal_payload_GBps": GOAL_GBPS,
        "goal_met": binary_best >= GOAL_GBPS,
        "binary_best_payload_GBps": binary_best,
        "binary_best_payload_GBps_cpu_bound": binary_cpu,
        "ceiling": ceiling,
        "payload_GBps": {
            enc: {r["fraction"]: r["payload_GBps"] for r in rows if r["encoding"] == enc}
            for enc in ("binary", "json", "bytes", "socket")
        },
        "json_equals_binary_bitwise": json_equal,
        "scaling": scaling,
        "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
    }
    return write_results(args.out, result)


if __name__ == "__main__":
    raise SystemExit(main())
