"""Peak GPU memory per phase of a server child (`engines/memory/peaks.py`): requests bracketed by their phase,
overlapping requests each see every peak of their interval, `held` the current figures; the teacher and the
rollout servers answer `POST /memory_peaks` ({} on CPU), and the controller's keys name the child.

The CUDA allocator's statistics are simulated (a fake `torch.cuda` peak counter): CPU CI has no GPU; the H200
run (benchmarks/gpu_memory.py) measures the real ones.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from mopd_hpc.engines.memory import peaks as pm
from mopd_hpc.trainer.phase_memory import server_peaks

G = 2**30


class FakeAllocator:
    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def use(self, gib: float) -> None:
        self.now = int(gib * G)
        self.peak = max(self.peak, self.now)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: self.peak)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d=None: 2 * self.peak)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: self.now)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 2 * self.now)
        monkeypatch.setattr(
            torch.cuda, "reset_peak_memory_stats", lambda d=None: setattr(self, "peak", self.now)
        )


def test_requests_fold_their_peaks_into_their_phases(monkeypatch: pytest.MonkeyPatch) -> None:
    mem = FakeAllocator()
    mem.install(monkeypatch)
    tracker = pm.PeakTracker(torch.device("cuda", 0))
    mem.use(1)  # weights
    with tracker.activity("teacher"):
        mem.use(9)  # scoring buffers
        mem.use(1)
    with tracker.activity("rollout"):
        mem.use(3)
        with tracker.activity("sync"):  # overlaps the rollout request: both see its peak
            mem.use(5)
            mem.use(2)
        mem.use(4)  # after the sync request's end: the rollout's only
    mem.use(1.5)
    got = tracker.read()
    assert got == {
        "teacher": {"allocated_gib": 9.0, "reserved_gib": 18.0},
        "rollout": {"allocated_gib": 5.0, "reserved_gib": 10.0},
        "sync": {"allocated_gib": 5.0, "reserved_gib": 10.0},
        "held": {"allocated_gib": 1.5, "reserved_gib": 3.0},
    }
    assert tracker.read() == {"held": {"allocated_gib": 1.5, "reserved_gib": 3.0}}  # forgotten once read
    assert pm.PeakTracker(torch.device("cpu")).read() == {} and not pm.PeakTracker(None).active


class Client:
    def __init__(self, answer: dict) -> None:
        self.answer = answer

    async def memory_peaks(self) -> dict:
        return self.answer


def test_the_controller_keys_name_each_server() -> None:
    teacher = {"teacher": {"allocated_gib": 2.0, "reserved_gib": 3.0}, "held": {"allocated_gib": 1.0}}
    rollout = {"rollout": {"reserved_gib": 4.0}}
    got = asyncio.run(server_peaks({"math": Client(teacher)}, [Client(rollout)]))
    assert got == {
        "memory/teacher/math/teacher/allocated_gib": 2.0,
        "memory/teacher/math/teacher/reserved_gib": 3.0,
        "memory/teacher/math/held/allocated_gib": 1.0,
        "memory/rollout/0/rollout/reserved_gib": 4.0,
    }
    assert asyncio.run(server_peaks({}, [Client({})])) == {}  # a server on CPU (or without NVML) answers {}


def test_the_servers_answer_memory_peaks_on_cpu() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from mopd_hpc.engines.rollout.http_app import PHASE_OF_PATH as ROLLOUT_PHASES
    from mopd_hpc.engines.teacher.http_app import PHASE_OF_PATH as TEACHER_PHASES

    assert TEACHER_PHASES == {"/score": "teacher", "/onload": "teacher", "/offload": "drain"}
    assert ROLLOUT_PHASES["/generate"] == "rollout" and ROLLOUT_PHASES["/awex/update_weights"] == "sync"
    from aiohttp import web

    async def scenario() -> None:
        app = web.Application(middlewares=[pm.peak_middleware(pm.PeakTracker(None), {"/x": "teacher"})])

        async def handler(request: web.Request) -> web.Response:
            return web.json_response({"ok": True})

        app.router.add_post("/x", handler)
        pm.add_peaks_route(app.router, pm.PeakTracker(None))
        async with TestClient(TestServer(app)) as client:
            assert await (await client.post("/x")).json() == {"ok": True}
            assert await (await client.post(pm.PEAKS_PATH)).json() == {}

    asyncio.run(scenario())


def test_the_rollout_child_allocates_with_expandable_segments_unless_told_otherwise() -> None:
    from mopd_hpc.roles.rollout import allocator_env

    assert allocator_env({}) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert allocator_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}) == {}  # the user's stays
