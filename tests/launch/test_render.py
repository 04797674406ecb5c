"""Rendering sbatch scripts: golden files, `bash -n`, hostile inputs, and the batch shell's control flow.

The control-flow tests EXECUTE rendered scripts with fake `srun`/`scancel`/`scontrol` on PATH (shell stubs
that write what they were called with; the fake srun runs its task in a new session, as slurmstepd would)
and the real `launchers/node.sh` in front of a fake guard (Python: it records its argv/env and the signals
it gets). Signals are sent the way Slurm's `B:` signal arrives: to the batch shell's process group, i.e. the
shell and its own children (the srun processes), never to the steps' tasks.

Golden files: tests/golden/*.sbatch; regenerate with `MOPD_REGEN_GOLDEN=1 pytest tests/launch/test_render.py`.
"""

from __future__ import annotations

import difflib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mopd_hpc.launch.jobspec import Component, JobSpec, JobSpecError
from mopd_hpc.launch.render import TEMPLATES_DIR, RenderError, SbatchRequest, render
from mopd_hpc.launch.rundir import RunDir, prepare_run_dir

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
NODE_SH = REPO / "launchers" / "node.sh"
JOB_ID = "4242"
WAIT_S = 30.0  # upper bound for a fake job to reach a state; never a timing assertion

FAKE_SRUN = r"""#!/bin/bash
# fake srun: record argv, run the task in its own session (as slurmstepd would), exit with its code
printf '%s\n' "$*" >>"$FAKE_DIR/srun.calls"
group=0
while [[ $# -gt 0 && $1 == -* ]]; do
  case $1 in --het-group=*) group=${1#--het-group=} ;; esac
  shift
done
setsid "$@" &
task=$!
wait "$task"
rc=$?
echo "$group $rc" >>"$FAKE_DIR/srun.exits"
exit "$rc"
"""
FAKE_SCANCEL = r"""#!/bin/bash
# fake scancel: record argv; deliver the signal (default TERM) to the steps' tasks only
printf '%s\n' "$*" >>"$FAKE_DIR/scancel.calls"
sig=TERM
for a in "$@"; do case $a in --signal=*) sig=${a#--signal=} ;; esac; done
for f in "$FAKE_DIR"/tasks/*.pid; do [[ -e $f ]] && kill -s "$sig" "$(cat "$f")" 2>/dev/null; done
exit 0
"""
FAKE_SCONTROL = r"""#!/bin/bash
printf '%s\n' "$*" >>"$FAKE_DIR/scontrol.calls"
exit 0
"""
FAKE_GUARD = r"""
import json, os, signal, sys, time
fake = os.environ["FAKE_DIR"]
group = os.environ["MOPD_HET_GROUP"]

def on_signal(signum, frame):
    with open(os.path.join(fake, f"guard.{group}.signals"), "a") as f:
        f.write(signal.Signals(signum).name.removeprefix("SIG") + "\n")
    sys.exit(0 if signum == signal.SIGUSR2 else 128 + signum)  # USR2: "checkpointed", exit 0

stuck = group in os.environ.get("FAKE_STUCK_GROUPS", "").split()  # a hung guard: ignores every signal
signal.signal(signal.SIGUSR2, signal.SIG_IGN if stuck else on_signal)
signal.signal(signal.SIGTERM, signal.SIG_IGN if stuck else on_signal)
record = {"argv": sys.argv[1:], "env": {k: v for k, v in os.environ.items() if k.startswith("MOPD_")}}
with open(os.path.join(fake, "tasks", f"{group}.pid"), "w") as f:
    f.write(str(os.getpid()))
tmp = os.path.join(fake, f".guard.{group}.json")
with open(tmp, "w") as f:
    json.dump(record, f)
os.replace(tmp, os.path.join(fake, f"guard.{group}.json"))
deadline = time.monotonic() + 60
if group in os.environ.get("FAKE_END_GROUPS", "").split():
    while not all(os.path.exists(os.path.join(fake, f"guard.{g}.json")) for g in os.environ["FAKE_GROUPS"].split()):
        time.sleep(0.02)
    sys.exit(int(os.environ["FAKE_END_RC"]))
while time.monotonic() < deadline:
    time.sleep(0.02)
sys.exit(99)
"""


def _component(group: int, name: str, **kw: object) -> Component:
    return Component(het_group=group, name=name, **kw)  # type: ignore[arg-type]


def golden_het_spec() -> JobSpec:
    return JobSpec.heterogeneous(
        job_name="mopd-demo",
        run_dir="/scratch/runs/demo",
        trainer=_component(
            0,
            "trainer",
            nodes=1,
            gpus_per_node=8,
            cpus_per_task=32,
            mem_gb=256,
            partition="gpu",
            account="proj",
            roles=("actor", "teacher"),
        ),
        rollout=_component(
            1,
            "rollout",
            nodes=2,
            gpus_per_node=8,
            cpus_per_task=32,
            mem_gb=256,
            partition="gpu",
            qos="high",
            roles=("rollout",),
            extra_sbatch=("--constraint=h200",),
        ),
        launcher="/opt/mopd_hpc/launchers/node.sh",
        guard_command=("/opt/venv/bin/mopd-guard",),
        secret_file="/scratch/runs/demo/guard.token",
        time_min=240,
        max_requeues=2,
        extra_sbatch=("--mail-type=END,FAIL",),
    )


def golden_colocated_spec() -> JobSpec:
    return JobSpec.colocated(
        job_name="mopd-colocated",
        run_dir="/scratch/runs/colo",
        component=_component(
            0, "group", nodes=1, cpus_per_task=4, mem_gb=1.5, roles=("actor", "teacher", "rollout")
        ),
        launcher="/opt/mopd_hpc/launchers/node.sh",
        guard_command=("/opt/venv/bin/python", "-m", "mopd_hpc.cli.guard"),
        secret_file="/scratch/runs/colo/guard.token",
        requeue=False,
        signal="USR2@90",
    )


def _bash_n(script: str) -> None:
    done = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def _directives(script: str) -> list[list[str]]:
    """The words of every `#SBATCH` line (sbatch reads them until the first command), shell-split."""
    out = []
    for line in script.splitlines()[1:]:
        if line.startswith("#SBATCH"):
            out.append(shlex.split(line[len("#SBATCH") :]))
        elif line.strip() and not line.startswith("#"):
            break
    return out


@pytest.mark.parametrize(
    ("name", "make"), [("heterogeneous", golden_het_spec), ("colocated", golden_colocated_spec)]
)
def test_golden(name: str, make) -> None:
    script = render(make()).script
    path = GOLDEN / f"{name}.sbatch"
    if os.environ.get("MOPD_REGEN_GOLDEN") == "1":
        path.write_text(script)
    assert path.exists(), (
        f"{path} is missing: run `MOPD_REGEN_GOLDEN=1 pytest tests/launch/test_render.py` once"
    )
    expected = path.read_text()
    if script != expected:
        diff = "".join(
            difflib.unified_diff(expected.splitlines(True), script.splitlines(True), str(path), "rendered")
        )
        pytest.fail(
            f"rendered {name} script differs from {path}:\n{diff}\nIf the change is intended, regenerate with "
            "`MOPD_REGEN_GOLDEN=1 pytest tests/launch/test_render.py` and review the diff"
        )
    _bash_n(script)


def test_het_directives_and_steps() -> None:
    script = render(golden_het_spec()).script
    blocks: list[list[str]] = [[]]
    for words in _directives(script):
        if words == ["hetjob"]:
            blocks.append([])
        else:
            blocks[-1].extend(words)
    assert len(blocks) == 2
    assert blocks[0] == [
        "--job-name=mopd-demo",
        "--time=240",
        "--signal=B:USR2@120",
        "--requeue",
        "--open-mode=append",
        "--output=/scratch/runs/demo/logs/batch.%j.log",
        "--mail-type=END,FAIL",
        "--nodes=1",
        "--ntasks-per-node=1",
        "--cpus-per-task=32",
        "--mem=256G",
        "--gpus-per-node=8",
        "--partition=gpu",
        "--account=proj",
    ]
    assert blocks[1] == [
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=32",
        "--mem=256G",
        "--gpus-per-node=8",
        "--partition=gpu",
        "--qos=high",
        "--constraint=h200",
    ]
    srun_lines = [line for line in script.splitlines() if line.startswith("mopd_spawn srun")]
    assert [line.split()[2] for line in srun_lines] == ["--het-group=0", "--het-group=1"]
    assert "--nodes=2 --ntasks=2 --ntasks-per-node=1" in srun_lines[1]
    assert "--overlap" not in script  # each step owns its component: disjoint resources


def test_colocated_has_one_step_without_het_group() -> None:
    request = render(golden_colocated_spec())
    script = request.script
    assert "hetjob" not in script and "--het-group=" not in script
    assert ["--no-requeue"] in _directives(script)
    assert ["--mem=1536M"] in _directives(script)
    assert ["--signal=USR2@90"] in _directives(script)
    assert script.count("mopd_spawn srun") == 1
    assert "MOPD_GUARD=(/opt/venv/bin/python -m mopd_hpc.cli.guard)" in script


def test_show_prints_command_then_script() -> None:
    request = render(golden_het_spec())
    shown = request.show()
    assert shown.splitlines()[0] == "sbatch --parsable $SBATCH_SCRIPT"
    assert shown.endswith(request.script)
    assert repr(request) == shown
    assert isinstance(request, SbatchRequest) and request.cmd == ("sbatch", "--parsable")


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"requeue": False},
        {"signal": "12@60"},
        {"signal": "B:TERM@300", "requeue_on_term": True},
        {"extra_sbatch": ("--exclusive", "--comment=a b;c")},
    ],
)
def test_every_variant_passes_bash_n(changes: dict) -> None:
    spec = golden_het_spec().replace(**changes)
    _bash_n(render(spec).script)
    overlapped = spec.replace(
        components=(spec.components[0], _component(1, "rollout", nodes=1, overlap=True))
    )
    script = render(overlapped).script
    _bash_n(script)
    assert script.count("--overlap") == 1


def test_hostile_values_stay_quoted(weird_tmp_path: Path) -> None:
    run_dir = str(weird_tmp_path / 'r "q" $(touch pwned) `touch pwned2` 50%j')
    spec = golden_het_spec().replace(
        job_name='a\'; echo x "$(touch pwned)"',
        run_dir=run_dir,
        secret_file=run_dir + "/guard.token",
        extra_sbatch=("--comment=x; echo y",),
    )
    script = render(spec).script
    _bash_n(script)
    words = _directives(script)
    assert words[0] == ['--job-name=a\'; echo x "$(touch pwned)"']
    output = [w[0] for w in words if w[0].startswith("--output=")]
    assert output == ["--output=" + run_dir.replace("%", "%%") + "/logs/batch.%j.log"]
    assert ["--comment=x; echo y"] in words
    # The shell assigns exactly the values (run the assignment lines in bash and read them back).
    assigns = [
        line for line in script.splitlines() if line.startswith(("MOPD_RUN_DIR=", "MOPD_LOG_PATTERN="))
    ]
    done = subprocess.run(
        ["bash", "-c", "\n".join(assigns) + '\nprintf "%s\\n%s" "$MOPD_RUN_DIR" "$MOPD_LOG_PATTERN"'],
        capture_output=True,
        text=True,
        check=True,
        cwd=weird_tmp_path,
    )
    assert done.stdout.split("\n") == [run_dir, run_dir.replace("%", "%%") + "/logs"]
    assert not list(weird_tmp_path.rglob("pwned*"))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"shape": "heterogeneous", "components": ()}, "a heterogeneous job has >= 2"),
        ({"run_dir": "relative/dir"}, "JobSpec.run_dir='relative/dir': expected an absolute path"),
        ({"run_dir": "/a\nb"}, "newlines"),
        ({"job_name": "a\\b"}, "backslashes"),
        ({"signal": "B:KILL@60"}, "cannot be trapped"),
        ({"signal": "B:USR2@20000"}, "before the end of a 240-minute job"),
        ({"extra_sbatch": ("--time=5",)}, "--time is rendered from JobSpec.time_min"),
        ({"extra_sbatch": ("constraint=x",)}, "expected one long option"),
        ({"max_requeues": -1}, "JobSpec.max_requeues=-1: expected an integer >= 0"),
        ({"guard_command": ()}, "JobSpec.guard_command=(): expected a non-empty argv"),
    ],
)
def test_jobspec_rejects(changes: dict, message: str) -> None:
    with pytest.raises(JobSpecError, match=None) as info:
        golden_het_spec().replace(**changes)
    assert message in str(info.value)


def test_jobspec_rejects_component_errors() -> None:
    spec = golden_het_spec()
    swapped = (spec.components[1], spec.components[0])
    with pytest.raises(JobSpecError, match=r"components\[0\]\.het_group=1: expected 0"):
        spec.replace(components=swapped)
    with pytest.raises(JobSpecError, match="Component.name='Trainer'"):
        _component(0, "Trainer", nodes=1)
    with pytest.raises(JobSpecError, match="nodes=0: expected an integer >= 1"):
        _component(0, "trainer", nodes=0)
    with pytest.raises(JobSpecError, match="--mem is rendered from Component.mem_gb"):
        _component(0, "trainer", nodes=1, extra_sbatch=("--mem=4G",))


def test_unquoted_template_value_is_an_error(tmp_path: Path) -> None:
    for name in ("heterogeneous.sbatch.j2", "colocated.sbatch.j2"):
        (tmp_path / name).write_text("#!/bin/bash\n#SBATCH --job-name={{ spec.job_name }}\n")
    with pytest.raises(RenderError, match=r"unquoted: pipe it through `\| q`"):
        render(golden_het_spec(), templates_dir=tmp_path)
    with pytest.raises(RenderError, match="not found"):
        render(golden_het_spec(), templates_dir=tmp_path / "missing")
    assert (TEMPLATES_DIR / "heterogeneous.sbatch.j2").is_file()


# ------------------------------------------------------------------------------------------------
# Executing rendered scripts with fake Slurm commands.


class FakeJob:
    """A rendered script run by bash in its own process group, with fake Slurm commands on PATH."""

    def __init__(self, root: Path, spec: JobSpec, env: dict[str, str]) -> None:
        self.fake = root / "fake"
        (self.fake / "tasks").mkdir(parents=True)
        self.script_path = root / "job.sbatch"
        self.script_path.write_text(render(spec).script)
        self.run_dir = RunDir.at(spec.run_dir)
        full_env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MOPD_"))},
            "PATH": f"{_fake_bin(root)}:{os.environ['PATH']}",
            "FAKE_DIR": str(self.fake),
            "SLURM_JOB_ID": JOB_ID,
            **env,
        }
        self.log = (root / "batch.log").open("w")
        self.proc = subprocess.Popen(
            ["bash", str(self.script_path)],
            env=full_env,
            start_new_session=True,
            stdout=self.log,
            stderr=self.log,
        )

    def lines(self, name: str) -> list[str]:
        path = self.fake / name
        return path.read_text().splitlines() if path.exists() else []

    def guard(self, group: int) -> dict:
        return json.loads((self.fake / f"guard.{group}.json").read_text())

    def state(self, name: str) -> dict:
        return json.loads((self.run_dir.state / name).read_text())

    def wait_for_guards(self, groups: list[int]) -> None:
        deadline = time.monotonic() + WAIT_S
        while not all((self.fake / f"guard.{g}.json").exists() for g in groups):
            assert self.proc.poll() is None, f"batch script exited early:\n{self.batch_log()}"
            assert time.monotonic() < deadline, f"guards {groups} never started:\n{self.batch_log()}"
            time.sleep(0.02)

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"batch script did not end:\n{self.batch_log()}")

    def batch_log(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid_file in (self.fake / "tasks").glob("*.pid"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        self.log.close()


def _fake_bin(root: Path) -> Path:
    bin_dir = root / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        for name, text in (("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL), ("scontrol", FAKE_SCONTROL)):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        guard = bin_dir / "fake-guard"
        guard.write_text(f"#!{sys.executable}\n{FAKE_GUARD}")
        guard.chmod(0o755)
    return bin_dir


def _local_spec(root: Path, shape: str = "heterogeneous", **changes: object) -> JobSpec:
    run_dir = prepare_run_dir(root / "run")
    common = dict(
        run_dir=str(run_dir.root),
        launcher=str(NODE_SH),
        guard_command=(str(_fake_bin(root) / "fake-guard"), "--verbose"),
        secret_file=str(run_dir.secret_file),
        stop_grace_s=20,
        checkpoint_grace_s=20,
        max_requeues=2,
    )
    if shape == "heterogeneous":
        spec = JobSpec.heterogeneous(
            job_name="fake",
            trainer=_component(0, "trainer", nodes=1, roles=("actor", "teacher")),
            rollout=_component(1, "rollout", nodes=2, roles=("rollout",)),
            **common,
        )
    else:
        spec = JobSpec.colocated(
            job_name="fake", component=_component(0, "group", nodes=1, roles=("actor",)), **common
        )
    return spec.replace(**changes)


@pytest.fixture()
def fake_job(tmp_path: Path):
    jobs: list[FakeJob] = []

    def start(spec: JobSpec, **env: str) -> FakeJob:
        job = FakeJob(tmp_path, spec, env)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.cleanup()


@pytest.mark.parametrize("poll", ["0", "1"])
def test_watchdog_records_first_failure_and_cancels(tmp_path: Path, fake_job, poll: str) -> None:
    job = fake_job(
        _local_spec(tmp_path),
        FAKE_GROUPS="0 1",
        FAKE_END_GROUPS="1",
        FAKE_END_RC="3",
        MOPD_WATCHDOG_POLL=poll,
    )
    rc = job.wait()
    log = job.batch_log()
    assert rc == 3, log
    failure = job.state("first_failure.json")
    assert {k: failure[k] for k in ("component", "het_group", "exit_code", "job_id", "restart_count")} == {
        "component": "rollout",
        "het_group": 1,
        "exit_code": 3,
        "job_id": JOB_ID,
        "restart_count": 0,
    }
    assert job.lines("scancel.calls") == [f"--signal=TERM {JOB_ID}"]
    assert job.lines("guard.0.signals") == ["TERM"]
    assert sorted(job.lines("srun.exits")) == ["0 143", "1 3"]
    assert job.lines("scontrol.calls") == []
    assert "component rollout failed first (exit code 3)" in log
    assert job.state("job.json") == {
        "job_id": JOB_ID,
        "restart_count": 0,
        "shape": "heterogeneous",
        "components": ["trainer", "rollout"],
    }
    # node.sh named the het group and exec'd the guard with the run dir and the leader's job id.
    for group, name, roles in ((0, "trainer", "actor,teacher"), (1, "rollout", "rollout")):
        guard = job.guard(group)
        assert guard["argv"] == ["--verbose", "--run-dir", str(job.run_dir.root), "--job-id", JOB_ID]
        assert {k: v for k, v in guard["env"].items() if k != "MOPD_WATCHDOG_POLL"} == {
            "MOPD_HET_GROUP": str(group),
            "MOPD_COMPONENT": name,
            "MOPD_ROLES": roles,
            "MOPD_RUN_DIR": str(job.run_dir.root),
            "MOPD_SECRET_FILE": str(job.run_dir.secret_file),
        }
    srun_calls = job.lines("srun.calls")
    assert sorted(c.split()[0] for c in srun_calls) == ["--het-group=0", "--het-group=1"]


def test_first_step_ending_cleanly_ends_the_job(tmp_path: Path, fake_job) -> None:
    job = fake_job(_local_spec(tmp_path), FAKE_GROUPS="0 1", FAKE_END_GROUPS="0", FAKE_END_RC="0")
    assert job.wait() == 0, job.batch_log()
    assert not (job.run_dir.state / "first_failure.json").exists()
    assert job.lines("scancel.calls") == [f"--signal=TERM {JOB_ID}"]
    assert job.lines("guard.1.signals") == ["TERM"]


def test_colocated_failure(tmp_path: Path, fake_job) -> None:
    job = fake_job(_local_spec(tmp_path, "colocated"), FAKE_GROUPS="0", FAKE_END_GROUPS="0", FAKE_END_RC="7")
    assert job.wait() == 7, job.batch_log()
    assert job.state("first_failure.json")["component"] == "group"
    assert job.lines("scancel.calls") == []  # nothing left to cancel
    assert job.lines("srun.calls")[0].startswith("--nodes=1 --ntasks=1")  # no --het-group in a plain job


@pytest.mark.parametrize("poll", ["0", "1"])
def test_signal_is_forwarded_to_steps_and_sruns_survive(tmp_path: Path, fake_job, poll: str) -> None:
    job = fake_job(_local_spec(tmp_path), FAKE_GROUPS="0 1", MOPD_WATCHDOG_POLL=poll)
    job.wait_for_guards([0, 1])
    os.killpg(job.proc.pid, signal.SIGUSR2)  # Slurm's B:USR2: the batch shell and its children (the sruns)
    rc = job.wait()
    assert rc == 0, job.batch_log()
    assert job.lines("scancel.calls") == [f"--signal=USR2 {JOB_ID}"]
    assert job.lines("guard.0.signals") == ["USR2"] and job.lines("guard.1.signals") == ["USR2"]
    # Both srun processes outlived the signal and reported their task's exit (a killed srun reports nothing).
    assert sorted(job.lines("srun.exits")) == ["0 0", "1 0"]
    assert job.lines("scontrol.calls") == [f"requeue {JOB_ID}"]
    assert job.state("last_signal.json")["signal"] == "USR2"
    assert job.state("requeue.json")["restart_count"] == 0
    assert not (job.run_dir.state / "first_failure.json").exists()


@pytest.mark.parametrize(
    ("requeue_on_term", "rc", "scontrol"), [(False, 143, []), (True, 0, [f"requeue {JOB_ID}"])]
)
def test_term_is_forwarded_and_requeues_only_when_asked(
    tmp_path: Path, fake_job, requeue_on_term: bool, rc: int, scontrol: list[str]
) -> None:
    job = fake_job(_local_spec(tmp_path, requeue_on_term=requeue_on_term), FAKE_GROUPS="0 1")
    job.wait_for_guards([0, 1])
    os.killpg(job.proc.pid, signal.SIGTERM)
    assert job.wait() == rc, job.batch_log()
    assert job.lines("scancel.calls") == [f"--signal=USR2 {JOB_ID}"]
    assert sorted(job.lines("srun.exits")) == ["0 0", "1 0"]
    assert job.lines("scontrol.calls") == scontrol


def test_no_requeue_past_max_requeues(tmp_path: Path, fake_job) -> None:
    job = fake_job(_local_spec(tmp_path), FAKE_GROUPS="0 1", SLURM_RESTART_COUNT="2")
    job.wait_for_guards([0, 1])
    os.killpg(job.proc.pid, signal.SIGUSR2)
    assert job.wait() == 128 + signal.SIGUSR2, job.batch_log()
    assert job.lines("scontrol.calls") == []
    assert "restart count 2 reached max_requeues=2" in job.batch_log()
    assert job.state("last_signal.json")["restart_count"] == 2


def test_hostile_run_dir_executes(weird_tmp_path: Path, fake_job) -> None:
    root = weird_tmp_path / 'x "y" $(touch pwned) %j'
    root.mkdir()
    spec = _local_spec(root).replace(job_name="a'; echo x; touch pwned")
    job = fake_job(spec, FAKE_GROUPS="0 1", FAKE_END_GROUPS="0", FAKE_END_RC="5")
    assert job.wait() == 5, job.batch_log()
    assert job.state("first_failure.json")["component"] == "trainer"
    assert job.guard(1)["argv"][1:3] == ["--run-dir", spec.run_dir]
    assert not list(weird_tmp_path.rglob("pwned")) and not (Path.cwd() / "pwned").exists()


def test_grace_timer_ends_the_job_when_a_guard_hangs(tmp_path: Path, fake_job) -> None:
    spec = _local_spec(tmp_path, stop_grace_s=1)
    job = fake_job(spec, FAKE_GROUPS="0 1", FAKE_END_GROUPS="1", FAKE_END_RC="4", FAKE_STUCK_GROUPS="0")
    assert job.wait() == 4, job.batch_log()
    assert job.state("first_failure.json")["component"] == "rollout"
    assert "grace period over with 1 step(s) running" in job.batch_log()
    assert job.lines("srun.exits") == ["1 4"]  # the hung step's srun was killed, Slurm would end its task
