"""A spawn runs only what it names: its env may set only `MOPD_*` keys, env_policy.ALLOWED_KEYS and the keys
the site allowed (`mopd-guard --allow-env`); any other key is a 403 naming the key and a `spawn_refused`
event, before any port is leased or any process started (runtime/guard/env_policy.py); a loader or
interpreter key cannot be allowed by a site; every accepted override is in the guard's `spawn` event,
secret-looking values redacted. Through a real `mopd-guard`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers_wait import until
from test_guard import RunningGuard, raw, start_guard, stop_guard

from mopd_hpc.config import load_run_config
from mopd_hpc.plan.placement import place_children
from mopd_hpc.runtime.guard.client import GuardForbiddenError
from mopd_hpc.runtime.guard.env_policy import REDACTED, denial
from mopd_hpc.runtime.guard.spawn_env import check_overrides
from mopd_hpc.runtime.plan import child_environment

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def guard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGuard]:
    g = start_guard(tmp_path_factory.mktemp("guard"), extra_args=["--allow-env", "TMPDIR"])
    try:
        yield g
    finally:
        stop_guard(g)


def sitecustomize_attack(tmp: Path) -> tuple[Path, Path]:
    """A directory whose sitecustomize.py runs a shell that writes `marker`: what PYTHONPATH=DIR runs."""
    payload, marker = tmp / "payload", tmp / "pwned"
    payload.mkdir()
    (payload / "sitecustomize.py").write_text(
        f"import subprocess\nsubprocess.run(['/bin/sh', '-c', 'echo $$ > {marker}'])\n"
    )
    return payload, marker


def test_the_pythonpath_sitecustomize_attack_is_403_and_no_child_runs(
    guard: RunningGuard, tmp_path: Path
) -> None:
    payload, marker = sitecustomize_attack(tmp_path)
    subprocess.run([sys.executable, "-c", "pass"], env={"PYTHONPATH": str(payload)}, check=True, timeout=60)
    assert marker.exists()  # the payload is real: any python started with this PYTHONPATH runs the shell
    marker.unlink()
    before = len(guard.events)
    with pytest.raises(GuardForbiddenError) as info:
        guard.spawn_test(20, "envdump", env={"PYTHONPATH": str(payload)}, ports=["http"])
    assert info.value.status == 403
    assert info.value.message.startswith(
        "env key PYTHONPATH may not be set by a spawn: the Python interpreter"
    )
    time.sleep(1.0)  # a child, had one started, would have run its sitecustomize by now
    assert not marker.exists()
    assert guard.client.status(role="testchild", index=20)["children"] == []
    assert [p for p in guard.client.status()["ports"] if p["index"] == 20] == []  # nothing was leased
    new = guard.events[before:]
    assert [e["event"] for e in new] == ["spawn_refused"]
    assert new[0]["reason"] == info.value.message and "PYTHONPATH" in new[0]["keys"]
    assert not list((guard.run_dir / "logs").glob("**/testchild-20.*"))


@pytest.mark.parametrize(
    "key",
    [
        "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "PYTHONSTARTUP", "PYTHONHOME", "PYTHONWARNINGS",
        "PYTHONUSERBASE", "PATH", "HOME", "BASH_ENV", "ENV", "BASH_FUNC_ls%%", "PERL5LIB", "NODE_OPTIONS",
        "GCONV_PATH", "GLIBC_TUNABLES", "CC",
        # off the allow-list (issue 41): each steers which code, cache or certificate a child loads
        "HF_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "SSL_CERT_FILE", "HTTPS_PROXY", "NCCL_NET_PLUGIN",
    ],
)  # fmt: skip
def test_keys_off_the_allow_list_are_403_naming_the_key(guard: RunningGuard, key: str) -> None:
    body = json.dumps({"role": "testchild", "index": 21, "env": {key: "/tmp/x"}}).encode()
    status, answer = raw(guard.client.url, "POST", "/spawn", body, guard.token)
    if "%" in key:  # not an identifier: refused as malformed (400) before the policy
        assert (status, answer["error"]) == (400, "bad_env")
        return
    assert (status, answer["error"]) == (403, "env_denied"), answer
    assert answer["message"].startswith(f"env key {key} may not be set by a spawn: ")
    assert guard.client.status(role="testchild", index=21)["children"] == []
    refused = [e for e in guard.events if e["event"] == "spawn_refused" and e["index"] == 21]
    assert refused[-1]["keys"] == [key] and refused[-1]["reason"] == answer["message"]
    if key in ("HF_HOME", "SSL_CERT_FILE"):  # not a loader key: the way out is the site's list
        assert f"mopd-guard --allow-env {key}" in answer["message"]


def test_accepted_overrides_are_recorded_with_secrets_redacted(guard: RunningGuard) -> None:
    env = {
        "NCCL_DEBUG": "INFO",
        "MOPD_HF_TOKEN": "hf_abc123",
        "MOPD_WANDB_API_KEY": "k-456",
        "TMPDIR": "/tmp",
    }
    child = guard.spawn_test(22, "envdump", env=env)
    assert until((guard.work / "env-testchild-22.g1.json").exists, 20), Path(child["stderr"]).read_text()
    (spawn,) = [e for e in guard.events if e["event"] == "spawn" and e["index"] == 22]
    assert spawn["env"] == {
        "GUARD_TEST_DIR": str(guard.work),
        "GUARD_TEST_MODE": "envdump",
        "MOPD_HF_TOKEN": REDACTED,
        "NCCL_DEBUG": "INFO",
        "TMPDIR": "/tmp",  # the site's key (--allow-env TMPDIR)
        "MOPD_WANDB_API_KEY": REDACTED,
    }
    text = (guard.run_dir / "events" / "testhost.guard.jsonl").read_text()
    assert "hf_abc123" not in text and "k-456" not in text
    assert "hf_abc123" not in guard.err.read_text() + guard.out.read_text()


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_plans_child_env_passes_the_policy(name: str) -> None:
    plan = place_children(load_run_config(REPO / "configs" / name))
    envs = [child_environment(c, "slurm", 2) for c in (*plan.children, *plan.as_probe().children)]
    assert envs and all(k.startswith("MOPD_") for env in envs for k in env)
    for env in envs:
        check_overrides(env)  # raises on a refused key
    assert denial("MOPD_TRANSFER_RANKS") is None and denial("PYTORCH_CUDA_ALLOC_CONF") is None


@pytest.mark.parametrize("key", ["LD_PRELOAD", "PYTHONPATH", "PATH", "bad key"])
def test_a_site_cannot_allow_a_loader_key(tmp_path: Path, key: str) -> None:
    (tmp_path / "run").mkdir()
    argv = [sys.executable, "-m", "mopd_hpc.cli.guard", "--run-dir", str(tmp_path / "run"), "--job-id", "j"]
    done = subprocess.run([*argv, "--allow-env", key], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("mopd-guard: --allow-env ") and key in done.stderr
    assert "Traceback" not in done.stderr
