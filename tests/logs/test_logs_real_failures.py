"""`mopd-logs summarize` on failures caused for real: a real guard (`mopd-guard --extra-role`) runs real children
that fail — a bind on a port a foreign process holds (the guard's own lease skips it), a raised exception on
three ranks, a probe exiting with a code, a probe killed with SIGKILL by the test, a teacher whose tokenizer
differs from the actor's (`check_models` on two micro tokenizers, inside the child) — and a probe job that hits
its time limit on the local Slurm cluster. Each test asserts the named cause, the failing role, index and host.

This file is also the test roles' entry point: the guard runs `python -m test_logs_real_failures` (tests/ on
PYTHONPATH) and `__main__` dispatches on MOPD_ROLE.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parents[1]
ROLE_MODULE = "test_logs_real_failures"
TEST_ROLES = ("bindbusy", "crash", "teacher")
#: Job id of the local guards (a valid port-lease owner id).
JOB_ID = "local-failtest"


# ---- the test roles (run inside guard children) ---------------------------------------------------------
def _bind_fixed_port(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("0.0.0.0", port))  # a fixed port from a config, not a leased one
        sock.listen()


def _load_batch(rank: int) -> None:
    shape = (rank, 0)
    if 0 in shape:
        raise ValueError(f"batch of rank {rank} has shape {shape}: expected a non-empty batch")


def _check_teacher(actor: str, teacher: str) -> None:
    from mopd_hpc.mopd.compatibility import ModelFiles, check_models

    check_models(ModelFiles("student", actor), [ModelFiles("legs", teacher)])


def role_main(env: dict[str, str]) -> int:
    role, index = env["MOPD_ROLE"], int(env["MOPD_INDEX"])
    print(f"{role}-{index}: starting (pid {os.getpid()})", flush=True)
    time.sleep(float(env.get("MOPD_TEST_DELAY_S", "0")))
    if role == "bindbusy":
        _bind_fixed_port(int(env["MOPD_TEST_PORT"]))
    elif role == "crash":
        _load_batch(index)
    elif role == "teacher":
        _check_teacher(env["MOPD_TEST_ACTOR"], env["MOPD_TEST_TEACHER"])
    print(f"{role}-{index}: done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(role_main(dict(os.environ)))


# ---- tests ----------------------------------------------------------------------------------------------
import pytest  # noqa: E402
from helpers_wait import wait_for  # noqa: E402

from mopd_hpc.launch.rundir import prepare_run_dir  # noqa: E402
from mopd_hpc.logs.summary import RunSummary, no_sacct, summarize_run  # noqa: E402
from mopd_hpc.runtime.guard.client import GuardClient  # noqa: E402

HOST = socket.gethostname()


@contextlib.contextmanager
def local_guard(run_dir: Path, port_range: str = "20000-32000") -> Iterator[GuardClient]:
    """A real `mopd-guard` (no plan) with the test roles registered; shut down (and checked gone) at exit."""
    rd = prepare_run_dir(run_dir)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), str(TESTS_DIR.parent)]),
        "MOPD_BACKEND": "local",
    }
    env = {k: v for k, v in env.items() if not k.startswith("SLURM")}
    argv = [sys.executable, "-m", "mopd_hpc.cli.guard", "--run-dir", str(rd.root), "--job-id", JOB_ID]
    argv += ["--host", HOST, "--port-range", port_range, "--kill-wait-s", "2"]
    for role in TEST_ROLES:
        argv += ["--extra-role", f"{role}={ROLE_MODULE}"]
    with open(rd.logs / "guard.test.log", "ab") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(
            lambda: (rd.root / "guards" / f"{HOST}.json").exists() or proc.poll() is not None, 30, "guard"
        )
        assert proc.poll() is None, (rd.logs / "guard.test.log").read_text()
        yield GuardClient.from_run_dir(rd.root, HOST, rd.secret_file, timeout_s=10)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_exited(client: GuardClient, role: str, index: int, timeout_s: float = 30) -> dict:
    def exited() -> dict | None:
        kids = client.status(role=role, index=index)["children"]
        return kids[-1] if kids and kids[-1]["state"] == "exited" else None

    return wait_for(exited, timeout_s, f"{role}-{index} to exit")  # type: ignore[return-value]


def summarize(run_dir: Path) -> RunSummary:
    return summarize_run(run_dir, sacct_runner=no_sacct)


def free_port(lo: int, hi: int) -> int:
    """The first port of [lo, hi] that binds now (the foreign process then holds it)."""
    for port in range(lo, hi + 1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    pytest.fail(f"no free port in {lo}..{hi}")


def test_address_in_use_from_a_port_a_foreign_process_holds(tmp_path: Path) -> None:
    port = free_port(23000, 23500)
    code = "import socket,sys,time; s=socket.socket(); s.bind(('0.0.0.0',int(sys.argv[1]))); s.listen(); print('held',flush=True); time.sleep(120)"
    foreign = subprocess.Popen([sys.executable, "-c", code, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert foreign.stdout is not None and foreign.stdout.readline().strip() == "held"
        # the lease range starts at the held port: the guard's lease must skip it (real bind check)
        with local_guard(tmp_path / "run", port_range=f"{port}-{port + 20}") as client:
            guard_port = int(client.url.rsplit(":", 1)[1])
            child = client.spawn("bindbusy", 2, env={"MOPD_TEST_PORT": str(port)}, ports=["http"])
            assert port not in (guard_port, child["ports"]["http"])
            assert port < child["ports"]["http"] <= port + 20
            ended = wait_exited(client, "bindbusy", 2)
            assert ended["exit_code"] == 1
    finally:
        foreign.kill()
        foreign.wait()
    s = summarize(tmp_path / "run")
    f = s.first_failure
    assert f is not None
    assert (f.cause.key, f.cause.title) == ("address_in_use", "address already in use")
    assert (f.host, f.role, f.index, f.exit_code, f.source) == (HOST, "bindbusy", 2, 1, "events")
    assert f.exception is not None and "Address already in use" in f.exception and "Errno 98" in f.exception
    assert any("_bind_fixed_port" in line for line in f.traceback)
    assert f.log_path == str(tmp_path / "run" / "logs" / HOST / "bindbusy-2.g1.err")
    assert s.job.state == "FAILED" and s.job.job_id == JOB_ID
    # a local job (local-failtest): no srun shell into an allocation, a tail of the child's log instead
    run = s.run_dir
    assert s.next_steps == (
        f"mopd-logs tail {run} --role bindbusy --rank 2",
        "mopd-debug ports",
        f"mopd-submit {run}/config.yaml --resume {run}",
    )


def test_a_raised_exception_first_rank_named_and_deduplicated(tmp_path: Path) -> None:
    with local_guard(tmp_path / "run") as client:
        client.spawn("crash", 0)
        wait_exited(client, "crash", 0)  # rank 0 fails first, the others the same way a moment later
        for rank in (1, 2):
            client.spawn("crash", rank, env={"MOPD_TEST_DELAY_S": "0.2"})
        for rank in (1, 2):
            assert wait_exited(client, "crash", rank)["exit_code"] == 1
    f = summarize(tmp_path / "run").first_failure
    assert f is not None
    assert (f.cause.key, f.cause.title) == ("exception", "unhandled ValueError")
    assert (f.host, f.role, f.index, f.exit_code) == (HOST, "crash", 0, 1)
    assert f.exception == "ValueError: batch of rank 0 has shape (0, 0): expected a non-empty batch"
    assert f.traceback[0] == "Traceback (most recent call last):"
    assert sorted(f.same_on) == [f"{HOST} crash-1", f"{HOST} crash-2"]
    assert [child for child, _ in f.cascade] == [f"{HOST} crash-1", f"{HOST} crash-2"] or sorted(
        f.cascade
    ) == [(f"{HOST} crash-1", "exception"), (f"{HOST} crash-2", "exception")]


def test_a_probe_exit_code_and_a_sigkilled_child(tmp_path: Path) -> None:
    with local_guard(tmp_path / "code") as client:
        client.spawn("probe", 4, env={"MOPD_PROBE_EXIT_CODE": "3"})
        assert wait_exited(client, "probe", 4)["exit_code"] == 3
    f = summarize(tmp_path / "code").first_failure
    assert f is not None
    assert (f.cause.key, f.cause.title, f.role, f.index, f.host) == (
        "exit_code", "exited with code 3", "probe", 4, HOST,
    )  # fmt: skip

    run_dir = tmp_path / "kill"
    with local_guard(run_dir) as client:
        client.spawn("probe", 0, env={"MOPD_PROBE_HOLD_S": "60"})
        victim = client.spawn("probe", 1, env={"MOPD_PROBE_HOLD_S": "60"})
        wait_for(lambda: (run_dir / "probe" / f"{HOST}-probe-1.json").exists(), 30, "probe 1's report")
        os.kill(victim["pid"], signal.SIGKILL)  # as the OOM killer or a careless user would
        ended = wait_exited(client, "probe", 1)
        assert (ended["signal"], ended["exit_code"]) == ("SIGKILL", None)
        time.sleep(0.1)
    s = summarize(run_dir)
    f = s.first_failure
    assert f is not None
    assert (f.cause.key, f.cause.title) == ("killed_by_signal", "killed by signal 9 (SIGKILL)")
    assert (f.host, f.role, f.index, f.signal, f.exit_code) == (HOST, "probe", 1, "SIGKILL", None)
    # probe 0 was stopped by the guard's teardown afterwards: not a failure, not in the cascade
    assert f.cascade == ()
    states = {c.index: c.state for c in s.children}
    assert (states[0], states[1]) == ("killed", "failed")  # torn down by the guard; the one SIGKILLed first


def _micro_tokenizer(path: Path, words: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    fast.save_pretrained(str(path))
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 8, "vocab_size": 8}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_a_teacher_with_a_mismatched_tokenizer(tmp_path: Path) -> None:
    words = ["<pad>", "<eos>", "<unk>", "one", "two", "legs", "cat", "="]
    actor = _micro_tokenizer(tmp_path / "student", words)
    same = _micro_tokenizer(tmp_path / "chain", words)
    other = _micro_tokenizer(tmp_path / "legs", words[:5] + ["paws"] + words[6:])
    with local_guard(tmp_path / "run") as client:
        client.spawn("teacher", 0, env={"MOPD_TEST_ACTOR": str(actor), "MOPD_TEST_TEACHER": str(same)})
        client.spawn("teacher", 1, env={"MOPD_TEST_ACTOR": str(actor), "MOPD_TEST_TEACHER": str(other)})
        assert wait_exited(client, "teacher", 0, 60)["exit_code"] == 0
        assert wait_exited(client, "teacher", 1, 60)["exit_code"] == 1
    s = summarize(tmp_path / "run")
    f = s.first_failure
    assert f is not None
    assert (f.cause.key, f.cause.title) == ("tokenizer_mismatch", "tokenizer mismatch")
    assert (f.host, f.role, f.index) == (HOST, "teacher", 1)
    assert f.exception is not None and f.exception.startswith(
        "mopd_hpc.mopd.compatibility.TokenizerMismatchError"
    )
    assert "token id 5: 'student' has 'legs', 'legs' has 'paws'" in f.exception
    assert {(c.index, c.state) for c in s.children} == {(0, "exited"), (1, "failed")}
    # the CLI's --json carries the same facts (schema of docs/en/logs.md)
    proc = subprocess.run(
        [sys.executable, "-m", "mopd_hpc.cli.logs", "summarize", str(tmp_path / "run"), "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr
    data = json.loads(proc.stdout)
    assert set(data) >= {
        "schema_version",
        "run_dir",
        "job",
        "nodes",
        "first_failure",
        "progress",
        "next_steps",
    }
    ff = data["first_failure"]
    assert set(ff) >= {
        "cause",
        "source",
        "host",
        "role",
        "index",
        "exception",
        "traceback",
        "same_on",
        "log_path",
    }
    assert (ff["cause"]["key"], ff["host"], ff["role"], ff["index"]) == (
        "tokenizer_mismatch",
        HOST,
        "teacher",
        1,
    )
    assert set(ff["cause"]) == {"key", "title", "evidence"}
    (node,) = data["nodes"]
    assert node["host"] == HOST
    assert sorted((c["role"], c["index"], c["state"]) for c in node["children"]) == [
        ("teacher", 0, "exited"), ("teacher", 1, "failed"),
    ]  # fmt: skip
    assert data["next_steps"] == [f"mopd-submit {tmp_path / 'run' / 'config.yaml'} --check"]


@pytest.mark.slurm
@pytest.mark.slow
def test_a_job_that_hits_its_time_limit(slurm_cluster, tmp_path: Path) -> None:
    from test_slurm_jobs import CONFIG, SUBMIT, job_gone, reports, stop, wait_idle

    wait_idle(slurm_cluster)
    run_dir = tmp_path / "run"
    # A 1-minute limit and probes that hold for 10. The warning signal is URG (ignored by default), not USR2:
    # Slurm may send it up to 60 s early, i.e. at once, and USR2 would make the guards checkpoint and stop.
    sets = ("cluster.time_min=1", "cluster.signal=URG@30", "cluster.requeue=false")
    argv = [str(SUBMIT), str(CONFIG), "--probe", "--run-dir", str(run_dir)]
    argv += [arg for s in sets for arg in ("--set", s)]
    proc = subprocess.run(
        argv, env={**slurm_cluster.env, "MOPD_PROBE_HOLD_S": "600"}, capture_output=True, text=True,
        timeout=120, cwd=REPO, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = re.search(r"submitted job (\d+)", proc.stdout)[1]  # type: ignore[index]
    try:
        wait_for(lambda: len(reports(run_dir)) == 5, 60, "the 5 probe reports", step_s=0.25)
        # The job's limit runs out now rather than a minute after its start, as an operator may shorten a running
        # job's limit (scontrol's EndTime); Slurm's own time-limit kill follows at its next check of the limits,
        # which runs every 30 s (PERIODIC_TIMEOUT in slurmctld.h): 60-90 s after the start without the update.
        end = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 2))
        slurm_cluster.run(["scontrol", "update", f"JobId={job_id}", f"EndTime={end}"])
        wait_for(lambda: job_gone(slurm_cluster, job_id), 60, f"job {job_id} to hit its limit", step_s=1)
    finally:
        stop(slurm_cluster, job_id)
    s = summarize_run(run_dir)  # with the real sacct of the local cluster
    f = s.first_failure
    assert f is not None
    assert (f.cause.key, f.cause.title, f.source) == ("time_limit", "time limit", "slurm_signal")
    assert f"*** JOB {job_id} ON n" in (f.cause.evidence or "") and "DUE TO TIME LIMIT" in f.cause.evidence
    assert f.host in ("n1", "n2", "n3") and (f.role, f.index) == (None, None)
    # every child was stopped by its guard after Slurm's SIGTERM: teardown, none counted as a failure
    assert {c.state for c in s.children} == {"killed"} and len(s.children) == 5
    assert {g.signals[0][1] for g in s.guards} == {"SIGTERM"}
