"""The GPU memory of an sglang rollout child's process tree per phase (issue 34; engines/rollout/tree_memory.py):
the tree from /proc over real processes, the driver's table faked (no GPU here) as NVML would give it per pid,
through the real sglang server's routes with a stand-in Engine, and the metrics the controller and
benchmarks/gpu_memory.py make of it: the release between phases shows (teacher, drain, train hold what is left
after the release; sync and rollout the whole pool)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import test_utils
from helpers_auth import AUTH, TOKEN
from test_sglang_backend import PORTS, FakeSGLangEngine

from mopd_hpc.engines.memory.peaks import peak_metrics
from mopd_hpc.engines.rollout import tree_memory as tm
from mopd_hpc.engines.rollout.sglang_backend import SGLangLaunch
from mopd_hpc.engines.rollout.sglang_server import SGLangRolloutServer, sglang_app

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from gpu_memory import child_peaks, measured_totals  # noqa: E402

GIB = 2**30
SPAWN = (
    "import subprocess, sys, time\n"
    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print(p.pid, flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def scheduler() -> Iterator[tuple[int, int]]:
    """A real child of this process with a child of its own (as sglang.Engine's scheduler and its worker):
    (child pid, grandchild pid)."""
    proc = subprocess.Popen([sys.executable, "-c", SPAWN], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(proc.stdout.readline())
        yield proc.pid, grandchild
    finally:
        for pid in (grandchild, proc.pid):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        proc.wait(timeout=10)


def test_the_tree_is_the_process_and_its_descendants(scheduler: tuple[int, int]) -> None:
    child, grandchild = scheduler
    parents = tm.proc_parents()
    assert parents[child] == os.getpid() and parents[grandchild] == child
    tree = tm.descendants(os.getpid(), parents)
    assert {os.getpid(), child, grandchild} <= tree and os.getppid() not in tree
    assert tm.descendants(grandchild, parents) == {grandchild}
    assert tm.descendants(1, {2: 1, 3: 2, 4: 9, 5: 3}) == {1, 2, 3, 5}
    assert tm.tree_gib({1: GIB, 3: 2 * GIB, 4: 8 * GIB}, {1, 2, 3, 5}) == 3.0


def test_nvidia_smi_lines_are_summed_per_pid() -> None:
    text = "1234, 30720\n1234, 512\n77, [N/A]\n\n"
    assert tm.parse_smi(text) == {1234: (30720 + 512) << 20, 77: 0}


class Driver:
    """The driver's per-process table (pid → bytes) as NVML would list it: this process (the rollout child's
    CUDA context), the scheduler and its worker, and an unrelated process (the actor) that must not count."""

    def __init__(self, child: int, grandchild: int) -> None:
        self.child, self.grandchild = child, grandchild
        self.table = {os.getpid(): GIB // 2, grandchild: GIB // 4, 1: 40 * GIB}
        self.pool(30 * GIB)

    def pool(self, nbytes: int) -> None:
        self.table[self.child] = nbytes

    def __call__(self) -> dict[int, int]:
        return dict(self.table)


class ReleasingEngine(FakeSGLangEngine):
    """The stand-in Engine whose release and resume move the scheduler's memory in the driver's table."""

    def __init__(self, driver: Driver) -> None:
        super().__init__()
        self.driver = driver

    def release_memory_occupation(self, tags: list[str]) -> None:
        super().release_memory_occupation(tags)
        self.driver.pool(GIB // 8)  # what torch_memory_saver leaves: the scheduler's allocator bookkeeping

    def resume_memory_occupation(self, tags: list[str]) -> None:
        super().resume_memory_occupation(tags)
        self.driver.pool(2 * GIB if tags == ["weights"] else 30 * GIB)


async def post(http: aiohttp.ClientSession, url: str, body: dict | None = None) -> dict:
    async with http.post(url, json=body or {}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def test_the_release_shows_in_the_phases_it_spans(scheduler: tuple[int, int]) -> None:
    driver = Driver(*scheduler)
    base_gib = (GIB // 2 + GIB // 4) / GIB  # the rollout child's context and the scheduler's worker

    async def scenario() -> tuple[dict, dict]:
        server = SGLangRolloutServer(
            SGLangLaunch.from_ports("/m", PORTS),
            ReleasingEngine(driver),
            memory=tm.TreeMemoryTracker(used=driver),
        )
        async with (
            test_utils.TestServer(sglang_app(server, TOKEN), host="127.0.0.1") as ts,
            aiohttp.ClientSession(headers=AUTH) as http,
        ):
            url = f"http://127.0.0.1:{ts.port}"
            # one step as trainer/rollout_memory.py drives it: release at ROLLOUT's end, resume around SYNC
            await post(
                http, url + "/release_memory_occupation", {"tags": ["kv_cache", "weights", "cuda_graph"]}
            )
            await post(http, url + "/resume_memory_occupation", {"tags": ["weights"]})
            await post(http, url + "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
            first = await post(http, url + "/memory_peaks")
            return first, await post(http, url + "/memory_peaks")

    first, second = asyncio.run(scenario())
    full, released = 30 + base_gib, 1 / 8 + base_gib
    assert first == {
        "rollout": {"reserved_gib": full},
        **{ph: {"reserved_gib": released} for ph in ("teacher", "drain", "train")},
        "sync": {"reserved_gib": full},
        "held": {"reserved_gib": full},
    }
    assert second == {"held": {"reserved_gib": full}}  # forgotten once read
    # the metrics line the controller writes, and the GPU's total per phase beside an actor of 20 GiB
    line = peak_metrics("rollout/0", first)
    line |= {
        f"memory/actor/{ph}/reserved_gib": 20.0 for ph in ("rollout", "teacher", "drain", "train", "sync")
    }
    assert child_peaks([line])["rollout/0"]["train"] == released
    totals = measured_totals([line])
    assert totals["train"] == totals["teacher"] == 20.0 + released and totals["rollout"] == 20.0 + full


def test_without_a_driver_table_the_server_answers_nothing(scheduler: tuple[int, int]) -> None:
    tracker = tm.TreeMemoryTracker(used=lambda: None)
    with tracker.activity(tm.RELEASE):
        pass
    assert tracker.read() == {} and tracker.sample() is None
