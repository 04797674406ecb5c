"""The 8-GPU colocated production shape (issue 9): `--check` passes, the `--dry-run` rank map is right, and a
config AWEX colocate mode cannot serve is rejected at validation (config/weight_sync_rules.py `awex_colocate`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from helpers_configs import set_dotted
from helpers_models import hub_cache_for
from test_cli_check import mopd_submit as cli_check_submit

from mopd_hpc.config import RunConfig
from mopd_hpc.config.problems import ConfigError
from mopd_hpc.launch.rankmap import rank_map_rows
from mopd_hpc.plan.placement import place_children

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "qwen3_8gpu_colocated.yaml"


def mopd_submit(*args: str | Path, hub_cache: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`mopd-submit` in a child process on a 200-column terminal; `hub_cache`: the hub cache it reads (offline)."""
    return cli_check_submit(*args, hub_cache=hub_cache, columns=200)


def test_check_refuses_what_has_not_run_on_gpus_naming_the_opt_in() -> None:
    proc = mopd_submit(
        "--check", CONFIG
    )  # valid, but megatron TP 8 and AWEX from 8 ranks have not run on GPUs
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    assert "this config is valid but asks for what the job's roles do not run yet (3):" in proc.stderr
    refused = [line for line in proc.stderr.splitlines() if line.startswith("  - ")]
    assert [line[4:].split(":")[0] for line in refused] == [
        "models.actor.tensor_parallel", "models.teachers[0].tensor_parallel", "weight_sync.backend",
    ]  # fmt: skip
    assert all(
        line.endswith("or allow_unverified: true (--allow-unverified) to run it unverified)")
        for line in refused
    )
    # AWEX from 8 trainer ranks names what has not run (trainer/rank_writer.py exists; its GPU test has not run)
    assert "weight_sync.backend: the awex sync from 8 trainer ranks (every rank a writer at its transfer rank) " \
        "has not run on GPUs" in proc.stderr and "tests/engines/test_awex_tp_gpu.py" in proc.stderr  # fmt: skip
    cfg = RunConfig.from_yaml(CONFIG)
    assert cfg.models.actor.engine == "megatron" and cfg.models.actor.tensor_parallel == 8
    assert (cfg.rollout.backend, cfg.rollout.engines.count, cfg.rollout.engines.tensor_parallel) == (
        "hf",
        8,
        1,
    )
    assert (cfg.weight_sync.backend, cfg.weight_sync.awex_mode) == ("awex", "colocate")
    assert cfg.rollout.mode == "colocated" and cfg.rollout.forked is True


def test_dry_run_rank_map() -> None:
    plan = place_children(RunConfig.from_yaml(CONFIG))
    assert (plan.infer_world, plan.train_world, plan.transfer_world) == (8, 8, 16)
    actors, teachers, rollouts = (
        sorted(plan.by_role(r), key=lambda c: c.index) for r in ("actor", "teacher", "rollout")
    )
    assert len(actors) == 8 and len(teachers) == 8 and len(rollouts) == 8
    all_gpus = tuple(str(g) for g in range(8))
    for i in range(8):
        a, t, r = actors[i], teachers[i], rollouts[i]
        assert a.gpus == t.gpus == r.gpus == all_gpus  # colocated: each child sees the node's GPUs
        # the colocated pair: trainer rank i, teacher rank i and rollout engine i all compute on GPU i
        assert a.gpus[a.device_index] == t.gpus[t.device_index] == r.gpus[r.device_index] == str(i)
        assert r.transfer_ranks == (i,) and a.transfer_ranks == (8 + i,)
        assert t.transfer_ranks == ()
        assert r.port_names == ("http", "nccl", "dist_init")
    assert sorted(x for c in plan.children for x in c.transfer_ranks) == list(range(16))  # dense
    assert {c.node_index for c in plan.children} == {0} and {c.het_group for c in plan.children} == {0}
    rows = rank_map_rows(plan)
    assert len(rows) == 24
    assert [r["transfer_rank"] for r in rows if r["role"] == "rollout"] == [str(i) for i in range(8)]
    proc = mopd_submit("--dry-run", CONFIG)
    assert proc.returncode == 0, proc.stderr
    assert "AWEX infer world 8 + train world 8 = 16" in proc.stdout


def _with(**changes: object) -> dict:
    """The 8-GPU config with `a__b__c=value` edits (keyword-friendly dotted keys)."""
    return set_dotted(
        yaml.safe_load(CONFIG.read_text()), {k.replace("__", "."): v for k, v in changes.items()}
    )


def test_awex_colocate_needs_one_rollout_rank_per_actor_gpu() -> None:
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(_with(rollout__engines__count=4))
    text = str(err.value)
    assert "rollout.engines" in text and "AWEX colocate pairs each of the actor's 8 GPUs" in text
    assert "count·tensor_parallel = 4·1 = 4" in text
    # the same fleet is fine with the torch broadcast, or with AWEX in separated mode
    RunConfig.from_dict(_with(rollout__engines__count=4, weight_sync={"backend": "torch"}))
    ok = RunConfig.from_dict(
        _with(rollout__backend="sglang", rollout__engines__count=2, rollout__engines__tensor_parallel=4)
    )
    assert ok.rollout.engines.count == 2


def test_awex_colocate_pairing_follows_rollout_mode_when_awex_mode_is_null() -> None:
    # awex_mode null + rollout.mode colocated is colocate mode: the same pairing rule applies
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(_with(rollout__engines__count=4, weight_sync__awex_mode=None))
    assert "AWEX colocate pairs each of the actor's 8 GPUs" in str(err.value)
    assert "or rollout.mode: separated (AWEX separate mode)" in str(err.value)
    # an awex_mode that contradicts rollout.mode is one problem, not also a pairing problem
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(_with(rollout__engines__count=4, rollout__mode="separated"))
    problems = [p.path for p in err.value.problems]
    assert "weight_sync.awex_mode" in problems and "rollout.engines" not in problems, problems


def test_awex_colocate_rejected_by_check_cli(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_with(rollout__engines__count=2)))
    proc = mopd_submit("--check", bad)
    assert proc.returncode == 2
    assert "AWEX colocate" in proc.stderr + proc.stdout


@pytest.mark.parametrize(
    "config", ["configs/qwen3_8gpu_colocated.yaml", "configs/gsm8k_qwen3_14b_to_0_6b.yaml"]
)
def test_production_engines_are_refused_at_submit_not_substituted(config: str, tmp_path: Path) -> None:
    """The job's roles have run the megatron actor at TP 1 and AWEX colocate from one rank only: a TP-8 config
    is valid (--dry-run works) but --check and mopd-submit refuse to run it without --allow-unverified,
    naming each field, before any process starts. Its hub ids (gsm8k: Qwen/Qwen3-0.6B, Qwen/Qwen3-14B) are in a hub
    cache built here, as on a host that downloaded them."""
    cache = hub_cache_for([REPO / config], tmp_path / "hub")
    check = mopd_submit("--check", REPO / config, hub_cache=cache)
    assert check.returncode == 2, check.stderr
    assert "  - models.actor.tensor_parallel: the actor role runs the megatron engine at tensor_parallel ≤ 1 " \
        "(one process): tensor_parallel 8 has not run with this engine yet: tests/engines/test_megatron_actor_group_gpu.py " \
        "(2 GPUs) has not run (got 8; expected ≤ 1, or allow_unverified: true (--allow-unverified) to run it " \
        "unverified)" in check.stderr  # fmt: skip
    dry = mopd_submit("--dry-run", REPO / config, "--run-dir", tmp_path / "dry")
    assert dry.returncode == 0 and "# warning: not run by the job's roles yet: models.actor.tensor_parallel: " \
        in dry.stdout, dry.stderr  # fmt: skip
    run = mopd_submit(REPO / config, "--run-dir", tmp_path / "run", hub_cache=cache)
    assert run.returncode == 2
    for field in ("models.actor.tensor_parallel", "weight_sync.backend"):
        assert f"{field}: " in run.stderr, run.stderr
    assert not (tmp_path / "run").exists()  # refused before the run directory is made


MODEL_CONFIGS = REPO / "tests" / "data" / "model_configs"
#: The production configs, the config.json of each model path (tests/data/model_configs, from the model cards),
#: and each hub id's or directory's field.
PRODUCTION = {
    "qwen3_8gpu_colocated": {  # random-initialized Qwen3-1.7B shapes, made on the node
        "models.actor.path": "Qwen3-1.7B", "models.teachers[0].path": "Qwen3-1.7B",
    },
    "gsm8k_qwen3_14b_to_0_6b": {"models.actor.path": "Qwen3-0.6B", "models.teachers[0].path": "Qwen3-14B"},
}  # fmt: skip


#: Rows × cache slots of one hf rollout engine's static KV cache: ⌈batch_size / engines⌉ · samples_per_prompt rows
#: of max_prompt_tokens + max_new_tokens slots.
KV_SLOTS = {"qwen3_8gpu_colocated": 32 * 1280, "gsm8k_qwen3_14b_to_0_6b": 128 * 3072}


def real_shape(root: Path, name: str) -> Path:
    """A model directory holding the micro model's tokenizer (with a chat template, as the released Qwen3 models
    ship one: the GSM8K source is `template: chat`) and weights under the config.json of `name` (what --check
    opens, and what the memory plan reads)."""
    from helpers_models import CHAT_TEMPLATE, save_micro_model_dir

    out = save_micro_model_dir(root / name)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "config.json").write_bytes((MODEL_CONFIGS / name / "config.json").read_bytes())
    return out


@pytest.mark.parametrize("config", list(PRODUCTION))
def test_production_config_passes_check_with_the_opt_in_and_fits_80_and_141_gib(
    config: str, tmp_path: Path
) -> None:
    """`--check --allow-unverified` passes (exit 0) with each GPU's memory plan under the card's memory (80
    GiB: H100, 141: H200), the three unverified settings printed as warnings; the plan's figures through the
    plan API: every GPU's peak under capacity, the hf rollout's static KV cache as config.json's arithmetic
    (layers · 2 · kv heads · head_dim · 2 bytes per slot and row)."""
    import json

    from mopd_hpc.config import load_run_config
    from mopd_hpc.plan.memory_plan import GIB
    from mopd_hpc.plan.residency_plan import planned_residency

    path = REPO / "configs" / f"{config}.yaml"
    dirs = {field: real_shape(tmp_path, name) for field, name in PRODUCTION[config].items()}
    sets = [f"{field}={d}" for field, d in dirs.items()]
    sets.append(f"models.tokenizer.path={dirs['models.actor.path']}")
    for capacity in (80, 141):
        args = [a for s in [*sets, f"cluster.group.gpu_memory_gb={capacity}"] for a in ("--set", s)]
        proc = mopd_submit("--check", path, "--allow-unverified", *args)
        assert proc.returncode == 0, proc.stderr
        warned = [line for line in proc.stdout.splitlines() if line.startswith("# warning: unverified: ")]
        assert [w.split(" = ")[0][len("# warning: unverified: ") :] for w in warned] == [
            "models.actor.tensor_parallel", "models.teachers[0].tensor_parallel", "weight_sync.backend",
        ]  # fmt: skip
        assert "gpu_memory_gb: the memory plan" not in proc.stdout
        cfg = load_run_config(
            path, [*sets, f"cluster.group.gpu_memory_gb={capacity}", "allow_unverified=true"]
        )
        _, gpus = planned_residency(cfg, place_children(cfg))
        assert len(gpus) == 8
        hf = json.loads((dirs["models.actor.path"] / "config.json").read_text())
        slot = hf["num_hidden_layers"] * 2 * hf["num_key_value_heads"] * hf["head_dim"] * 2
        kv = slot * KV_SLOTS[config]
        for gpu in gpus:
            peak, phase = gpu.peak()
            assert peak <= capacity * GIB, (config, capacity, gpu.gpu, peak / GIB, phase)
            (rollout,) = [c for c in gpu.children if c.label.startswith("rollout")]
            assert rollout.holding("KV cache").bytes == kv
        print(f"{config} @ {capacity} GiB: {gpus[0].peak()[0] / GIB:.1f} GiB per GPU ({gpus[0].peak()[1]})")
