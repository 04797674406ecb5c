"""The teacher role's tensor-parallel replica (roles/teacher_replica.py) as the guard starts it: a TP = 2
replica is two real processes of `python tests/engines/teacher_replica_prog.py` (the role's own entry point,
`roles.teacher.main`, with a stand-in shard engine on CPU), each in the environment the job plan gives its
child (`plan/placement.py` + `runtime/plan.py child_environment` + the guard's identity keys and leased
ports; the plan's GPUs replaced by none), in a run directory with the run's config.yaml and the job's token.

Config: configs/local_gpu_colocated_awex.yaml (the hf rollout) on a 2-GPU node with the teacher at tensor_parallel 2 (one replica:
the leader on the actor's GPU 0 with `http` and `master`, a follower on GPU 1) and a collective timeout of
COLLECTIVE_TIMEOUT_S. Oracle: the same role at tensor_parallel 1 (one process, the whole weight matrix).
Checks: the TP = 2 replica's /score answers (log-probs, top-k ids and log-probs) equal the TP = 1 replica's
within 1e-6 (float32: the shards' matmuls sum over the same hidden size; measured 0 here), ids equal; the
follower ran every request the leader broadcast; an idle replica lives past the collective timeout (the
leader's heartbeat); the end of the job and SIGTERM each stop both processes
with exit 0 and remove the endpoint and rendezvous records; a follower killed with SIGKILL makes the leader
exit non-zero within the collective timeout, its records removed, and a killed leader ends its follower so.
The place of each child in the replica (`replica_spec`, `teacher_args`) comes from the plan's variables.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import helpers_fork
import pytest
import torch
import yaml
from helpers_auth import TOKEN, write_run_dir_token
from helpers_ports import free_port
from teacher_replica_prog import STAND_IN
from teacher_tp_prog import VOCAB

from mopd_hpc.config import RunConfig
from mopd_hpc.engines.teacher.client import TeacherClient
from mopd_hpc.plan.placement import place_children
from mopd_hpc.records.job_end import write_job_end
from mopd_hpc.records.run_dir import CONFIG_FILE, teacher_endpoint_file, teacher_rendezvous_file
from mopd_hpc.roles.env import RoleEnv, RoleEnvError
from mopd_hpc.roles.teacher import teacher_args
from mopd_hpc.roles.teacher_replica import replica_spec
from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.plan import child_environment

REPO = Path(__file__).resolve().parents[2]
PROG = Path(__file__).with_name("teacher_replica_prog.py")
JOB = "local-4242"
TEACHER = "teacher"
COLLECTIVE_TIMEOUT_S = 10.0
START_S = 120.0


def replica_config(model: Path, tensor_parallel: int) -> RunConfig:
    doc = yaml.safe_load((REPO / "configs" / "local_gpu_colocated_awex.yaml").read_text())
    doc["models"]["teachers"][0].update(path=str(model), tensor_parallel=tensor_parallel, replicas=1)
    doc["models"]["actor"]["collective_timeout_s"] = COLLECTIVE_TIMEOUT_S
    doc["cluster"]["group"]["gpus_per_node"] = 2
    doc["weight_sync"] = {"backend": "torch"}
    return RunConfig.from_dict(doc)


def teacher_envs(cfg: RunConfig, run_dir: Path) -> list[dict[str, str]]:
    """The environment of each teacher child of the plan, in rank order, as its guard builds it (on CPU)."""
    plan = place_children(cfg)
    envs = []
    for child in plan.by_role("teacher"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOPD_")}
        env |= child_environment(child, "local", plan.het_size)
        env |= {
            child_env.ROLE: "teacher",
            child_env.INDEX: str(child.index),
            child_env.GENERATION: "1",
            child_env.JOB_ID: JOB,
            child_env.RUN_DIR: str(run_dir),
            child_env.HOST: "localhost",
            child_env.NODE_ADDR: "127.0.0.1",
            "CUDA_VISIBLE_DEVICES": "",  # the stand-in scores on CPU (gloo)
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),  # this checkout's mopd_hpc, not the one the venv installed
        }
        env.pop(child_env.BASE_GPU_ID, None)
        env |= {child_env.port_env_name(name): str(free_port()) for name in child.port_names}
        envs.append(env)
    return sorted(envs, key=lambda e: int(e[child_env.RANK]))


class Replica:
    """A teacher replica's children, started as the guard starts them (own session, cwd the run dir)."""

    def __init__(self, root: Path, tensor_parallel: int) -> None:
        model = root / "model"
        model.mkdir(parents=True)
        (model / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
        self.run_dir = root / "run"
        self.run_dir.mkdir()
        cfg = replica_config(model, tensor_parallel)
        (self.run_dir / CONFIG_FILE).write_text(cfg.to_yaml())
        write_run_dir_token(self.run_dir)
        self.envs = teacher_envs(cfg, self.run_dir)
        assert [e[child_env.WORLD_SIZE] for e in self.envs] == [str(tensor_parallel)] * tensor_parallel
        self.logs = [self.run_dir / f"teacher-{r}.err" for r in range(tensor_parallel)]
        self.procs = [
            helpers_fork.popen(
                [str(PROG)],
                env=env,
                cwd=self.run_dir,
                stdout=subprocess.DEVNULL,
                stderr=log.open("wb"),
                start_new_session=True,
            )  # fmt: skip
            for env, log in zip(self.envs, self.logs, strict=True)
        ]
        self.endpoint = teacher_endpoint_file(self.run_dir, TEACHER, 0)
        self.rendezvous = teacher_rendezvous_file(self.run_dir, TEACHER, 0)

    def tails(self) -> str:
        return "\n".join(f"--- rank {r}:\n{p.read_text()[-2500:]}" for r, p in enumerate(self.logs))

    def url(self) -> str:
        deadline = time.monotonic() + START_S
        while not self.endpoint.exists():
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                pytest.fail("the replica did not publish its endpoint:\n" + self.tails())
            time.sleep(0.05)
        record = json.loads(self.endpoint.read_text())
        assert record["job_id"] == JOB and record["teacher_id"] == TEACHER and record["replica"] == 0
        return record["url"]

    def wait(self, timeout_s: float = 60) -> list[int]:
        try:
            return [p.wait(timeout=timeout_s) for p in self.procs]
        except subprocess.TimeoutExpired:
            pytest.fail("the replica did not exit:\n" + self.tails())

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def requests(self) -> list[int]:
        """The requests each rank says it ran: the leader's broadcasts, each follower's SCOREs."""
        said = [
            re.search(r"stopped the followers after (\d+) request", self.logs[0].read_text()),
            *(re.search(r"STOP after (\d+) request", log.read_text()) for log in self.logs[1:]),
        ]
        assert all(said), self.tails()
        return [int(m.group(1)) for m in said if m]


def batches() -> list[tuple[list[list[int]], list[int], int | None]]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for count, k in ((6, 5), (3, None), (4, VOCAB)):
        rows, starts = [], []
        for _ in range(count):
            prompt = int(torch.randint(1, 7, (1,), generator=gen))
            response = int(torch.randint(1, 9, (1,), generator=gen))
            rows.append(torch.randint(0, VOCAB, (prompt + response,), generator=gen).tolist())
            starts.append(prompt)
        out.append((rows, starts, k))
    return out


def score(url: str) -> list:
    async def go():
        async with TeacherClient(url, token=TOKEN, timeout_s=60) as client:
            return [await client.score_tensors(rows, starts, k) for rows, starts, k in batches()]

    return asyncio.run(go())


@pytest.fixture
def replicas(tmp_path: Path):
    started: list[Replica] = []

    def start(name: str, tensor_parallel: int) -> Replica:
        started.append(Replica(tmp_path / name, tensor_parallel))
        return started[-1]

    yield start
    for replica in started:
        replica.kill()


def test_each_child_of_the_plan_gets_its_place_in_the_replica(tmp_path: Path) -> None:
    cfg = replica_config(tmp_path / "model", 2)
    envs = teacher_envs(cfg, tmp_path)
    roles = [RoleEnv.from_env(env) for env in envs]
    args = [teacher_args(r, cfg, env, STAND_IN.specs) for r, env in zip(roles, envs, strict=True)]
    leader, follower = (replica_spec(r, cfg, a, env) for r, a, env in zip(roles, args, envs, strict=True))
    assert leader is not None and follower is not None
    master = int(envs[0][child_env.port_env_name("master")])
    assert (leader.rank, leader.world_size, leader.master_host, leader.master_port) == (
        0,
        2,
        "127.0.0.1",
        master,
    )
    assert (follower.rank, follower.master_host, follower.master_port) == (1, None, None)
    assert (leader.backend, leader.device, leader.collective_timeout_s) == (
        "gloo",
        "cpu",
        COLLECTIVE_TIMEOUT_S,
    )
    assert leader.heartbeat_s == 2.0 and [a.rank for a in args] == [0, 1]
    assert (
        args[0].port == int(envs[0][child_env.port_env_name("http")]) and args[1].port == 0
    )  # no http lease
    with pytest.raises(
        RoleEnvError, match=r"^MOPD_WORLD_SIZE=2 but models\.teachers\[0\]\.tensor_parallel is 1"
    ):
        replica_spec(roles[0], cfg, dataclasses.replace(args[0], tensor_parallel=1), envs[0])
    # the job's own declarations refuse it, as --check does: megatron's teacher has not run at TP 2 on GPUs
    with pytest.raises(
        RoleEnvError, match=r"^models\.teachers\[0\]\.engine: .*models\.teachers\[0\]\.tensor_par"
    ):
        teacher_args(roles[0], cfg, envs[0])


def test_tp2_replica_scores_as_tp1_and_stops_with_the_job(replicas) -> None:
    tp2, tp1 = replicas("tp2", 2), replicas("tp1", 1)
    assert child_env.port_env_name("master") in tp2.envs[0] and len(tp1.envs) == 1
    got, want = score(tp2.url()), score(tp1.url())
    assert tp2.rendezvous.exists() and not tp1.rendezvous.exists()  # TP 1: no world, no rendezvous
    write_job_end(tp2.run_dir, JOB, "finished", step=1)
    write_job_end(tp1.run_dir, JOB, "finished", step=1)
    assert tp2.wait() == [0, 0], tp2.tails()
    assert tp1.wait() == [0], tp1.tails()
    assert tp2.requests() == [len(batches())] * 2  # the follower ran every /score the leader broadcast
    assert not tp2.endpoint.exists() and not tp2.rendezvous.exists() and not tp1.endpoint.exists()
    for (_, _, k), a, b in zip(batches(), got, want, strict=True):
        assert torch.equal(a.lengths, b.lengths)
        assert (a.logprobs - b.logprobs).abs().max().item() <= 1e-6
        if k is not None:
            assert torch.equal(a.topk_ids, b.topk_ids)
            assert (a.topk_logprobs - b.topk_logprobs).abs().max().item() <= 1e-6
        else:
            assert a.topk_ids is None and b.topk_ids is None


def test_an_idle_replica_outlives_the_collective_timeout_and_sigterm_stops_it(replicas) -> None:
    tp2 = replicas("tp2", 2)
    url = tp2.url()
    time.sleep(1.5 * COLLECTIVE_TIMEOUT_S)  # no request: the follower's wait lives on the leader's heartbeat
    assert all(p.poll() is None for p in tp2.procs), tp2.tails()
    score(url)
    for p in tp2.procs:  # as the guard stops a job's children: each its own process group
        os.killpg(p.pid, signal.SIGTERM)
    assert tp2.wait() == [0, 0], tp2.tails()
    assert tp2.requests() == [len(batches())] * 2
    assert not tp2.endpoint.exists() and not tp2.rendezvous.exists()


def test_a_killed_follower_ends_the_leader_within_the_collective_timeout(replicas) -> None:
    tp2 = replicas("tp2", 2)
    score(tp2.url())
    follower, leader = tp2.procs[1], tp2.procs[0]
    follower.kill()
    killed = time.monotonic()
    code = leader.wait(timeout=COLLECTIVE_TIMEOUT_S + 30)
    elapsed = time.monotonic() - killed
    assert code != 0, tp2.tails()
    assert elapsed < COLLECTIVE_TIMEOUT_S, (elapsed, tp2.tails())
    assert "ReplicaLostError" in tp2.logs[0].read_text()
    assert not tp2.endpoint.exists() and not tp2.rendezvous.exists()


def test_a_killed_leader_ends_the_follower_within_the_collective_timeout(replicas) -> None:
    tp2 = replicas("tp2", 2)
    score(tp2.url())
    tp2.procs[0].kill()
    killed = time.monotonic()
    code = tp2.procs[1].wait(timeout=COLLECTIVE_TIMEOUT_S + 30)
    assert code != 0 and time.monotonic() - killed < COLLECTIVE_TIMEOUT_S, tp2.tails()
    assert "ReplicaLostError" in tp2.logs[1].read_text()
