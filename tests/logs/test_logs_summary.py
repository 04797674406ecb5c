"""`summarize_run` on synthetic but realistic run directories: guard event logs in the guard's format, child
.err files holding real Python tracebacks (tests/data/logs/make_tracebacks.py raises the real exceptions),
a child really killed by SIGKILL, recorded sacct text. Asserts the named cause, failing host/role/index,
first-in-time across hosts, deduplication across ranks, the --json schema and the rendered screen."""

from __future__ import annotations

import io
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from mopd_hpc.cli import logs as logs_cli
from mopd_hpc.cli import logs_summarize
from mopd_hpc.logs.index import append_job_index
from mopd_hpc.logs.progress import SPARK_CHARS, TREND_WIDTH, bucket_index, sparkline
from mopd_hpc.logs.render import render_summary
from mopd_hpc.logs.summary import SCHEMA_VERSION, no_sacct, summarize_run
from mopd_hpc.runtime.guard.children import child_log_paths
from mopd_hpc.runtime.signals import signal_name

DATA = Path(__file__).resolve().parents[1] / "data" / "logs"
T0 = 1_790_000_000.0


@pytest.fixture(scope="module")
def tracebacks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Scenario name → the text of a real traceback (one interpreter run for all scenarios)."""
    out = tmp_path_factory.mktemp("tracebacks")
    subprocess.run([sys.executable, str(DATA / "make_tracebacks.py"), str(out)], check=True, timeout=120)
    texts = {p.stem: p.read_text() for p in out.glob("*.err")}
    assert {"address_in_use", "cuda_oom", "nccl_rank0", "tokenizer", "config"} <= set(texts)
    return texts


@pytest.fixture(scope="module")
def sigkill_exit() -> str:
    """The signal name of a real child killed by SIGKILL (the guard records `signal_name(-returncode)`)."""
    proc = subprocess.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert proc.returncode == -signal.SIGKILL
    return signal_name(-proc.returncode)


class RunBuilder:
    """Writes a run dir the way the guards and the batch shell do (events JSONL, child logs, state/*.json)."""

    def __init__(self, root: Path, job_id: str = "4242") -> None:
        self.root = root
        self.job_id = job_id
        self.events: dict[str, list[dict]] = {}
        (root / "state").mkdir(parents=True)
        (root / "logs").mkdir()
        (root / "state" / "job.json").write_text(
            json.dumps(
                {
                    "job_id": job_id,
                    "restart_count": 0,
                    "shape": "heterogeneous",
                    "components": ["train", "gen"],
                }
            )
        )

    def _emit(self, host: str, ts: float, event: str, **fields) -> None:
        self.events.setdefault(host, []).append({"ts": T0 + ts, "host": host, "event": event, **fields})

    def guard(self, host: str, start: float = 0.0, ready: bool = True) -> None:
        self._emit(host, start, "guard_start", pid=100, job_id=self.job_id)
        if ready:
            self._emit(host, start + 0.5, "guard_ready", pid=100, url="http://127.0.0.1:1", port=1)

    def child(
        self,
        host: str,
        role: str,
        index: int,
        spawn: float,
        exit_at: float | None = None,
        exit_code: int | None = None,
        sig: str | None = None,
        err: str = "",
        out: str = "",
        killed_at: float | None = None,
        generation: int = 1,
    ) -> None:
        out_path, err_path = child_log_paths(self.root, host, role, index, generation)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(out)
        err_path.write_text(err)
        ident = {"role": role, "index": index, "generation": generation, "pid": 1000 + index}
        self._emit(
            host,
            spawn,
            "spawn",
            module=f"m.{role}",
            stdout=str(out_path),
            stderr=str(err_path),
            ports={},
            gpus=None,
            **ident,
        )
        if killed_at is not None:
            self._emit(host, killed_at, "kill", signal="SIGTERM", **ident)
        if exit_at is not None:
            self._emit(host, exit_at, "exit", exit_code=exit_code, signal=sig, **ident)

    def guard_signal(self, host: str, ts: float, name: str = "SIGTERM") -> None:
        self._emit(host, ts, "guard_signal", signal=name, pid=100)

    def guard_stop(self, host: str, ts: float) -> None:
        self._emit(host, ts, "guard_stop", pid=100)

    def metrics(self, n: int, routes: tuple[str, ...] = ("gsm8k", "legs")) -> None:
        with open(self.root / "metrics.jsonl", "w") as fh:
            for step in range(n):
                line = {
                    "step": step,
                    "ts": T0 + step,
                    "loss/total": 2.0 - step * 0.01,
                    "loss/mopd": 1.5 - step * 0.01,
                    "loss/rl": 0.5,
                    "mopd/reverse_kl": 0.8 / (1 + step),
                    "mopd/rho_mean": 1.0,
                    "perf/tokens_per_s": 1000.0 + step,
                    "time/rollout_s": 3.0,
                    "time/teacher_s": 1.0,
                    "time/drain_s": 0.0,
                    "time/train_s": 4.0,
                    "time/sync_s": 2.0,
                    "time/train/prepare_s": 0.5,  # parts of time/train_s: not counted again in the shares
                    "time/train/forward_backward_s": 2.0,
                    "time/train/optimizer_s": 1.0,
                    "extra/unknown": "ignored",
                }
                for i, r in enumerate(routes):
                    line[f"reward/{r}"] = 0.1 * i + step / n
                    line[f"accuracy/{r}"] = min(1.0, step / n + 0.05 * i)
                fh.write(json.dumps(line) + "\n")
            fh.write('{"step": "torn')  # a torn last line is skipped

    def write(self) -> Path:
        events = self.root / "events"
        events.mkdir(exist_ok=True)
        for host, evs in self.events.items():
            with open(events / f"{host}.guard.jsonl", "w") as fh:
                for ev in sorted(evs, key=lambda e: e["ts"]):
                    fh.write(json.dumps(ev, sort_keys=True) + "\n")
        return self.root


def _render(summary) -> str:
    buf = io.StringIO()
    render_summary(summary, Console(file=buf, width=200, color_system=None))
    return buf.getvalue()


def test_oom_first_then_nccl_cascade_and_guard_teardown(tmp_path: Path, tracebacks: dict[str, str]) -> None:
    b = RunBuilder(tmp_path / "run")
    for host in ("n1", "n2"):
        b.guard(host)
    b.child("n1", "actor", 0, 1, exit_at=100, exit_code=1, err=tracebacks["cuda_oom"])
    for rank in range(1, 8):
        host = "n1" if rank < 4 else "n2"
        b.child(host, "actor", rank, 1, exit_at=700 + rank, exit_code=1, err=tracebacks[f"nccl_rank{rank}"])
    b.child("n2", "rollout", 0, 1, exit_at=710, sig="SIGTERM", killed_at=709)  # the guard's own kill
    s = summarize_run(b.write(), sacct_runner=no_sacct)
    f = s.first_failure
    assert f is not None
    assert (f.cause.key, f.host, f.role, f.index, f.exit_code) == ("cuda_oom", "n1", "actor", 0, 1)
    assert f.exception.startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert f.same_on == ()
    assert [key for _, key in f.cascade] == ["nccl"] * 7
    assert [label for label, _ in f.cascade][:2] == ["n1 actor-1", "n1 actor-2"]
    assert "n2 rollout-0" not in [label for label, _ in f.cascade]
    assert s.job.state == "FAILED" and s.job.state_source == "run_dir"
    slots = {(c.host, c.role, c.index): c.state for c in s.children}
    assert slots[("n2", "rollout", 0)] == "killed" and slots[("n1", "actor", 0)] == "failed"
    assert s.next_steps[0] == f"mopd-submit {s.run_dir}/config.yaml --check"
    screen = _render(s)
    assert "CUDA out of memory" in screen and "then (cascade): n1 actor-1 (nccl)" in screen


def test_same_traceback_on_eight_ranks_is_deduplicated(tmp_path: Path, tracebacks: dict[str, str]) -> None:
    b = RunBuilder(tmp_path / "run")
    for rank in range(8):
        host = f"n{rank // 4 + 1}"
        b.guard(host)
        b.child(
            host,
            "actor",
            rank,
            1,
            exit_at=600 + (rank - 5) % 8,
            exit_code=1,
            err=tracebacks[f"nccl_rank{rank}"],
        )
    s = summarize_run(b.write(), sacct_runner=no_sacct)
    f = s.first_failure
    assert (f.cause.key, f.host, f.index) == ("nccl", "n2", 5)  # exits at 600 + (rank-5)%8: rank 5 first
    assert len(f.same_on) == 7 and "n1 actor-0" in f.same_on and "n2 actor-5" not in f.same_on
    assert "same on 7 other ranks" in _render(s)
    assert s.to_dict()["first_failure"]["same_on_count"] == 7


def test_first_in_time_across_hosts_ignores_guard_kills(tmp_path: Path, tracebacks: dict[str, str]) -> None:
    b = RunBuilder(tmp_path / "run")
    for host in ("n1", "n2", "n3"):
        b.guard(host)
    b.child("n1", "rollout", 0, 1, exit_at=40, sig="SIGTERM", killed_at=39)  # killed by the guard: not it
    b.child("n1", "actor", 0, 1, exit_at=60, exit_code=1, err=tracebacks["nccl_rank0"])
    b.child("n3", "teacher", 1, 1, exit_at=50, exit_code=1, err=tracebacks["tokenizer"])
    b.child("n2", "teacher", 0, 1, exit_at=55, exit_code=1, err=tracebacks["tokenizer"])
    s = summarize_run(b.write(), sacct_runner=no_sacct)
    f = s.first_failure
    assert (f.cause.key, f.host, f.role, f.index) == ("tokenizer_mismatch", "n3", "teacher", 1)
    assert f.same_on == ("n2 teacher-0",)
    assert f.cascade == (("n2 teacher-0", "tokenizer_mismatch"), ("n1 actor-0", "nccl"))
    assert f.log_path.endswith("logs/n3/teacher-1.g1.err") and f.log_tail[-1].startswith("mopd_hpc.mopd")


def test_address_in_use_names_rollout_and_ports_command(tmp_path: Path, tracebacks: dict[str, str]) -> None:
    b = RunBuilder(tmp_path / "run")
    b.guard("n3")
    b.child("n3", "rollout", 2, 1, exit_at=5, exit_code=1, err=tracebacks["address_in_use"])
    s = summarize_run(b.write(), sacct_runner=no_sacct)
    f = s.first_failure
    assert (f.cause.key, f.cause.title, f.host, f.role, f.index) == (
        "address_in_use",
        "address already in use",
        "n3",
        "rollout",
        2,
    )
    assert f.cause.evidence == "OSError: [Errno 98] Address already in use"
    assert s.next_steps[:2] == ("mopd-debug shell 4242 --node n3", "mopd-debug ports")


def test_sigkill_is_killed_by_signal_9(tmp_path: Path, sigkill_exit: str, tracebacks: dict[str, str]) -> None:
    b = RunBuilder(tmp_path / "run")
    b.guard("n1")
    b.child("n1", "actor", 2, 1, exit_at=30, sig=sigkill_exit, err="step 10 loss 1.2\n")
    b.child("n1", "actor", 3, 1, exit_at=90, exit_code=1, err=tracebacks["nccl_rank3"])
    s = summarize_run(b.write(), sacct_runner=no_sacct)
    f = s.first_failure
    assert (f.cause.key, f.cause.title, f.signal, f.index) == (
        "killed_by_signal",
        "killed by signal 9 (SIGKILL)",
        "SIGKILL",
        2,
    )
    assert f.cascade == (("n1 actor-3", "nccl"),)


def test_config_error_and_restarts(tmp_path: Path, tracebacks: dict[str, str]) -> None:
    b = RunBuilder(tmp_path / "run")
    b.guard("n1")
    b.child("n1", "actor", 0, 1, exit_at=3, exit_code=2, err=tracebacks["config"])
    b.child("n1", "actor", 0, 4, exit_at=6, exit_code=2, err=tracebacks["config"], generation=2)
    s = summarize_run(b.write(), sacct_runner=no_sacct)
    f = s.first_failure
    assert (f.cause.key, f.generation) == ("config_error", 1)
    assert "unknown key" in "\n".join(f.traceback)
    assert f.same_on == ("n1 actor-0.g2",)
    (slot,) = s.children
    assert slot.restarts == 1 and slot.latest.generation == 2


def test_time_limit_from_recorded_sacct_and_slurmstepd_line(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path / "run", job_id="53")
    b.guard("n4")
    b.child("n4", "actor", 0, 1, exit_at=77.0, sig="SIGTERM")  # Slurm's SIGTERM reached it first
    b.guard_signal("n4", 77.5)
    b.guard_stop("n4", 79)
    shutil.copy(DATA / "slurm_out" / "timeout.slurm-53.out", b.root / "logs" / "batch.53.log")
    calls = []

    def sacct(argv):
        calls.append(list(argv))
        return (DATA / "sacct" / "sacct_timeout.txt").read_text()

    s = summarize_run(b.write(), sacct_runner=sacct)
    assert calls and calls[0][0] == "sacct" and "--jobs=53" in calls[0]
    f = s.first_failure
    assert (f.cause.key, f.source, f.host) == ("time_limit", "slurm_signal", "n4")
    assert "DUE TO TIME LIMIT" in f.cause.evidence
    assert s.job.state == "FAILED" and s.job.state_source == "sacct"
    assert s.job.sacct.components[0].state == "TIMEOUT"
    assert s.next_steps == (f"mopd-submit {s.run_dir}/config.yaml --resume {s.run_dir}",)


def test_het_job_from_sacct_folds_components(tmp_path: Path, tracebacks: dict[str, str]) -> None:
    b = RunBuilder(tmp_path / "run", job_id="51")
    b.guard("n2")
    b.child("n2", "actor", 0, 1, exit_at=3, exit_code=1, err=tracebacks["value_error"])
    s = summarize_run(
        b.write(), sacct_runner=lambda argv: (DATA / "sacct" / "sacct_het_failed.txt").read_text()
    )
    assert [c.component_id for c in s.job.sacct.components] == ["51+0", "51+1"]
    assert s.job.job_id == "51" and s.job.state == "FAILED"
    assert s.first_failure.cause.key == "exception" and s.first_failure.cause.title == "unhandled ValueError"
    assert "51+1" in _render(s)


def test_healthy_run_progress_json_schema_and_plot(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path / "run")
    b.guard("n1")
    b.child("n1", "actor", 0, 1, exit_at=100, exit_code=0, out="done\n")
    b.child("n1", "rollout", 0, 1, exit_at=101, exit_code=0)
    b.guard_stop("n1", 102)
    b.metrics(50)
    (b.root / "eval.json").write_text(
        json.dumps({"routes": {"gsm8k": {"teacher": 0.8, "student_start": 0.2, "student_end": 0.5, "n": 64}}})
    )
    s = summarize_run(b.write(), sacct_runner=no_sacct)
    assert s.first_failure is None and s.job.state == "SUCCEEDED" and s.next_steps == ()
    p = s.progress
    assert (p.n_lines, p.last_step, p.bad_lines) == (50, 49, 1)
    assert p.routes == ("gsm8k", "legs")
    assert p.phase_share == pytest.approx(
        {"rollout": 0.3, "teacher": 0.1, "drain": 0.0, "train": 0.4, "sync": 0.2}
    )
    assert p.last["loss/total"] == pytest.approx(2.0 - 0.49)
    assert p.last["time/train/forward_backward_s"] == 2.0  # the last line keeps the train phase's parts
    doc = json.loads(s.to_json())
    assert doc["schema_version"] == SCHEMA_VERSION == 1
    assert set(doc) == {
        "schema_version",
        "run_dir",
        "job",
        "nodes",
        "first_failure",
        "progress",
        "next_steps",
        "unreadable",
    }
    # RunBuilder's torn last line, named (logs/unreadable.py)
    assert doc["unreadable"] == [
        {"file": "metrics.jsonl", "lines": 1, "first_line": 51, "reason": "half-written"}
    ]
    assert set(doc["job"]) == {
        "job_id",
        "name",
        "shape",
        "components",
        "restart_count",
        "requeues",
        "state",
        "state_source",
        "sacct",
        "end",
        "earlier_jobs",
        "later_jobs",
        "refused",
        "unverified",
    }
    assert doc["job"]["earlier_jobs"] == [] and doc["job"]["later_jobs"] == [] and doc["job"]["refused"] == []
    assert set(doc["nodes"][0]) == {"host", "guard", "children"}
    assert set(doc["nodes"][0]["children"][0]) == {
        "host",
        "role",
        "index",
        "state",
        "exit_code",
        "signal",
        "restarts",
        "generations",
    }
    assert set(doc["progress"]) == {
        "n_lines",
        "first_step",
        "trend",
        "last_step",
        "last_ts",
        "loss",
        "mopd",
        "tokens_per_s",
        "routes",
        "phase_share",
        "phase_seconds",
        "series",
        "eval",
        "bad_lines",
    }
    assert doc["progress"]["routes"]["legs"]["accuracy"] == pytest.approx(min(1.0, 49 / 50 + 0.05))
    assert doc["progress"]["eval"]["gsm8k"]["student_end"] == 0.5
    screen = _render(s)
    assert "step 49" in screen and "train 40%" in screen and "no failure found" in screen
    png = tmp_path / "out.png"
    rc = logs_summarize.run(
        logs_cli_args(str(b.root), plot=str(png), json_out=True), out=io.StringIO(), err=io.StringIO(), env={}
    )
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def logs_cli_args(target: str, plot: str | None = None, json_out: bool = False, no_sacct_flag: bool = True):
    import argparse

    return argparse.Namespace(target=target, json=json_out, plot=plot, no_sacct=no_sacct_flag)


def test_cli_by_job_id_through_the_index(tmp_path: Path, tracebacks: dict[str, str], capsys) -> None:
    b = RunBuilder(tmp_path / "run", job_id="777")
    b.guard("n1")
    b.child("n1", "teacher", 0, 1, exit_at=9, exit_code=1, err=tracebacks["tokenizer"])
    b.write()
    state_home = tmp_path / "state"
    append_job_index({"job_id": "777", "run_dir": str(b.root), "name": "x", "submitted_at": T0}, state_home)
    out = io.StringIO()
    rc = logs_summarize.run(
        logs_cli_args("777+1", json_out=True), out=out, env={"XDG_STATE_HOME": str(state_home)}
    )
    assert rc == logs_summarize.EXIT_FAILED_RUN
    doc = json.loads(out.getvalue())
    assert doc["first_failure"]["cause"]["key"] == "tokenizer_mismatch" and doc["job"]["job_id"] == "777"
    err = io.StringIO()
    rc = logs_summarize.run(
        logs_cli_args("778"), out=io.StringIO(), err=err, env={"XDG_STATE_HOME": str(state_home)}
    )
    assert rc == 2 and "job 778 is not in the job index" in err.getvalue()
    assert logs_cli.main(["summarize", str(tmp_path / "nope"), "--no-sacct"]) == 2
    assert "neither a run directory nor a job id (123, 123+1, local-42)" in capsys.readouterr().err


def test_guard_that_never_got_ready_and_batch_first_failure(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path / "run")
    b.guard("n1", ready=False)
    (b.root / "logs" / "gen.r0.t0.log").write_text(
        "mopd_hpc.runtime.ports.PortInUseError: port 29500 for job 4242/guard/0/http is leased by another process\n"
    )
    s = summarize_run(b.write(), sacct_runner=no_sacct)
    assert (s.first_failure.cause.key, s.first_failure.source, s.first_failure.host) == (
        "port_lease_denied",
        "guard",
        "n1",
    )
    b2 = RunBuilder(tmp_path / "run2")
    (b2.root / "state" / "first_failure.json").write_text(
        json.dumps(
            {
                "component": "gen",
                "het_group": 1,
                "exit_code": 3,
                "job_id": "4242",
                "restart_count": 0,
                "time_unix": 5,
            }
        )
    )
    s2 = summarize_run(b2.write(), sacct_runner=no_sacct)
    assert (
        s2.first_failure.cause.key == "step_failed"
        and "component gen exited with code 3" in s2.first_failure.cause.title
    )


def test_logs_without_events_fall_back_to_tracebacks(tmp_path: Path, tracebacks: dict[str, str]) -> None:
    root = tmp_path / "run"
    (root / "logs" / "n1").mkdir(parents=True)
    (root / "logs" / "n1" / "actor-0.g1.err").write_text(tracebacks["cuda_oom"])
    s = summarize_run(root, sacct_runner=no_sacct)
    assert (s.first_failure.cause.key, s.first_failure.source, s.first_failure.host) == (
        "cuda_oom",
        "logs",
        "n1",
    )
    assert (s.first_failure.role, s.first_failure.index) == ("actor", 0)


def test_sparkline_covers_the_whole_run_in_bucket_means(tmp_path: Path) -> None:
    """2500 steps, loss falling linearly 2.73 → 0.12 with a null every 7th step and noise confined to the
    last 24 lines: the sparkline falls monotonically over all 24 buckets and is labelled steps 1–2500."""
    root = tmp_path / "run"
    root.mkdir()
    with open(root / "metrics.jsonl", "w") as fh:
        for step in range(1, 2501):
            loss = 2.73 - (2.73 - 0.12) * (step - 1) / 2499
            if step > 2476:
                loss += 0.5 * (-1) ** step  # the tail alone would draw noise
            value = None if step % 7 == 0 else loss
            fh.write(json.dumps({"step": step, "ts": T0 + step, "loss/total": value}) + "\n")
    s = summarize_run(root, sacct_runner=no_sacct)
    p = s.progress
    assert (p.first_step, p.last_step, p.trend_steps) == (1, 2500, (1, 2500))
    means = p.trend["loss/total"]
    assert len(means) == TREND_WIDTH == 24
    # bucket 0 holds the steps with (step - 1) * 24 // 2500 == 0, i.e. 1..105; nulls are skipped
    first_bucket = [st for st in range(1, 2501) if bucket_index(st, 1, 2500, 24) == 0]
    assert (first_bucket[0], first_bucket[-1]) == (1, 105)
    expected0 = [2.73 - 2.61 * (st - 1) / 2499 for st in first_bucket if st % 7]
    assert means[0] == pytest.approx(sum(expected0) / len(expected0))
    assert all(a > b for a, b in zip(means, means[1:], strict=False))
    line = sparkline(means)
    assert len(line) == 24 and line[0] == "█" and line[-1] == "▁"
    ranks = [SPARK_CHARS.index(ch) for ch in line]
    assert ranks == sorted(ranks, reverse=True)
    screen = _render(s)
    assert "trend, steps 1–2500 (mean per ~104 steps)" in screen
    row = next(r for r in screen.splitlines() if "loss/total" in r)
    assert line in row and " 0.62 " in row  # the last value column: the last line's (noisy) value, as before
    doc = json.loads(s.to_json())
    assert doc["progress"]["trend"]["steps"] == [1, 2500] and doc["progress"]["trend"]["buckets"] == 24
    assert doc["progress"]["trend"]["means"]["loss/total"] == pytest.approx(means)


def test_short_run_gets_one_bucket_per_step(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    lines = [{"step": st, "ts": T0, "loss/total": float(10 - st)} for st in range(5)]
    (root / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    p = summarize_run(root, sacct_runner=no_sacct).progress
    assert p.trend["loss/total"] == [10.0, 9.0, 8.0, 7.0, 6.0]
    assert sparkline(p.trend["loss/total"]) == "█▆▅▃▁"
    assert sparkline([1.0, None, float("nan"), 0.0]) == "█  ▁"


def _clean_run(root: Path, reason: str, step: int, job_id: str = "4242") -> Path:
    b = RunBuilder(root, job_id=job_id)
    b.guard("n1")
    b.child("n1", "actor", 0, 1, exit_at=100, exit_code=0, out="done\n")
    b.child("n1", "teacher", 0, 1, exit_at=101, exit_code=0)
    b.guard_stop("n1", 102)
    b.metrics(step)
    (root / "state" / "job_end.json").write_text(
        json.dumps({"job_id": job_id, "reason": reason, "step": step, "ts": T0 + 100})
    )
    return b.write()


def test_checkpoint_signal_run_is_checkpointed_and_resumable(tmp_path: Path) -> None:
    root = _clean_run(tmp_path / "run", "checkpoint_signal", 37)
    s = summarize_run(root, sacct_runner=no_sacct)
    assert s.first_failure is None
    assert (s.job.state, s.job.state_source, s.job.end_reason, s.job.end_step) == (
        "CHECKPOINTED",
        "run_dir",
        "checkpoint_signal",
        37,
    )
    resume = f"mopd-submit {root}/config.yaml --resume {root}"
    assert s.next_steps == (resume,)
    screen = _render(s)
    assert "state CHECKPOINTED" in screen and "SUCCEEDED" not in screen
    assert "stopped at step 37 on a checkpoint signal" in screen and "re-running the same command" in screen
    out = io.StringIO()
    assert logs_summarize.run(logs_cli_args(str(root), json_out=True), out=out, env={}) == 0
    doc = json.loads(out.getvalue())
    assert doc["job"]["state"] == "CHECKPOINTED"
    assert doc["job"]["end"] == {"reason": "checkpoint_signal", "step": 37}
    assert doc["next_steps"] == [resume]
    # sacct says COMPLETED (the actor exited 0): still CHECKPOINTED, from sacct
    recorded = (DATA / "sacct" / "sacct_timeout.txt").read_text().replace("53", "4242")
    recorded = recorded.replace("TIMEOUT", "COMPLETED").replace("CANCELLED|0:15", "COMPLETED|0:0")
    s2 = summarize_run(root, sacct_runner=lambda argv: recorded)
    assert [c.coarse_state for c in s2.job.sacct.components] == ["SUCCEEDED"]
    assert (s2.job.state, s2.job.state_source) == ("CHECKPOINTED", "sacct")


def test_finished_run_stays_succeeded_and_stale_marker_is_ignored(tmp_path: Path) -> None:
    root = _clean_run(tmp_path / "run", "finished", 50)
    s = summarize_run(root, sacct_runner=no_sacct)
    assert (s.job.state, s.job.end_reason, s.job.end_step, s.next_steps) == ("SUCCEEDED", "finished", 50, ())
    assert json.loads(s.to_json())["job"]["end"] == {"reason": "finished", "step": 50}
    assert "checkpoint signal" not in _render(s)
    # a checkpoint marker of another job (an earlier job in the same run dir) does not count
    other = _clean_run(tmp_path / "run2", "checkpoint_signal", 5)
    (other / "state" / "job_end.json").write_text(
        json.dumps({"job_id": "999", "reason": "checkpoint_signal", "step": 5, "ts": T0})
    )
    s2 = summarize_run(other, sacct_runner=no_sacct)
    assert (s2.job.state, s2.job.end_reason) == ("SUCCEEDED", None)


def test_no_cli_help_mentions_internal_issues() -> None:
    """Every verb's help and every program description of mopd_hpc/cli is free of "issue N" references."""
    import argparse
    import importlib
    import pkgutil
    import re

    import mopd_hpc.cli as cli_pkg

    texts = []
    for info in pkgutil.iter_modules(cli_pkg.__path__):
        module = importlib.import_module(f"mopd_hpc.cli.{info.name}")
        texts.append((info.name, module.__doc__ or ""))
        if hasattr(module, "add_arguments") and hasattr(module, "HELP"):
            parser = argparse.ArgumentParser(prog=info.name, description=module.HELP)
            module.add_arguments(parser)
            texts.append((info.name, parser.format_help()))
    assert len(texts) > 10
    assert [name for name, text in texts if re.search(r"\bissues? ?#?[0-9]", text, re.IGNORECASE)] == []
    parser_help = io.StringIO()
    with pytest.raises(SystemExit):
        import contextlib

        with contextlib.redirect_stdout(parser_help):
            logs_cli.main(["--help"])
    assert "summarize and tail a run's logs." in parser_help.getvalue()
    assert "issue" not in parser_help.getvalue().lower()
