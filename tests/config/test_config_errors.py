"""Every config rule and every field-error family: the error TEXT names the YAML path and the value.

Each case writes a bad YAML file (a mutation of configs/local_cpu.yaml) to tmp_path, loads it, and
asserts whole problem lines or their path + value + expectation.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from mopd_hpc.config import ConfigError, LossConfig, RunConfig, load_run_config

REPO = Path(__file__).resolve().parents[2]
BASE: dict[str, Any] = yaml.safe_load((REPO / "configs" / "local_cpu.yaml").read_text())


def slurm_gpus(d: dict[str, Any], gpus: int = 8, nodes: int = 1) -> None:
    """Make the base config a Slurm job with GPUs (rules about parallel sizes need GPUs)."""
    d["cluster"]["backend"] = "slurm"
    d["cluster"]["group"].update(gpus_per_node=gpus, nodes=nodes)


def het(d: dict[str, Any]) -> None:
    d["cluster"]["shape"] = "heterogeneous"
    group = d["cluster"].pop("group")
    d["cluster"]["trainer"] = dict(group)
    d["cluster"]["rollout"] = dict(group)
    d["rollout"]["mode"] = "separated"


def set_(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation that sets a dotted path (list items by integer parts)."""

    def mutate(d: dict[str, Any]) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        node: Any = d
        for p in parents:
            node = node[p]
        node[last] = value

    return mutate


def seq(*mutations: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def mutate(d: dict[str, Any]) -> None:
        for m in mutations:
            m(d)

    return mutate


def drop(path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(d: dict[str, Any]) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        node: Any = d
        for p in parents:
            node = node[p]
        del node[last]

    return mutate


def problems_of(tmp_path: Path, mutate: Callable[[dict[str, Any]], None]) -> list[str]:
    d = copy.deepcopy(BASE)
    mutate(d)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {len(info.value.problems)} problem")
    lines = [p.render() for p in info.value.problems]
    assert all(f"  - {line}" in message for line in lines)
    return lines


# (id, mutation, substrings that ONE problem line must all contain)
CASES: list[tuple[str, Callable[[dict[str, Any]], None], list[str]]] = [
    # --- cross-field rules -------------------------------------------------------------------
    (
        "unknown-teacher",
        set_("routes.chain", {"reasoner": 1.0}),
        ["routes.chain: unknown teacher 'reasoner' (known: chain, legs)"],
    ),
    (
        "both-coefficients-zero",
        set_("loss.distillation_coefficient", 0.0),
        [
            "loss.distillation_coefficient: distillation_coefficient and rl_coefficient are both 0",
            "(got 0.0;",
        ],
    ),
    (
        "both-coefficients-zero-whatever-alpha",
        seq(set_("loss.distillation_coefficient", 0.0), set_("loss.orm_alpha", 0.5)),
        ["loss.distillation_coefficient:", "orm_alpha=0.5 alone does not make a loss"],
    ),
    (
        "route-all-zero",
        set_("routes.chain", {"chain": 0.0}),
        ["routes.chain: no teacher has a weight > 0 (got {'chain': 0.0}"],
    ),
    ("route-empty", set_("routes.chain", {}), ["routes.chain: no teacher (got {}"]),
    (
        "route-negative",
        set_("routes.chain.chain", -1.0),
        ["routes.chain.chain:", "greater than or equal to 0", "(got -1.0)"],
    ),
    (
        "route-nan",
        set_("routes.chain.chain", float("nan")),
        ["routes.chain.chain:", "finite number", "got nan"],
    ),
    (
        "source-unknown-route",
        set_("data.sources.1.route", "mth"),
        ["data.sources[1].route: unknown route 'mth' (known: chain, legs)"],
    ),
    (
        "route-unused",
        set_("routes.spare", {"chain": 1.0}),
        ["routes.spare: no source in data.sources uses this route"],
    ),
    (
        "duplicate-teacher",
        set_("models.teachers.1.id", "chain"),
        ["models.teachers[1].id: duplicate model id (got 'chain'; already used by models.teachers[0].id)"],
    ),
    (
        "teacher-id-is-actor-id",
        set_("models.teachers.0.id", "student"),
        ["models.teachers[0].id: duplicate model id (got 'student'; already used by models.actor.id)"],
    ),
    (
        "duplicate-source",
        set_("data.sources.1.name", "chain_sum"),
        ["data.sources[1].name: duplicate source name (got 'chain_sum'; already used by data.sources[0])"],
    ),
    (
        "tp-not-dividing-gpus-per-node",
        seq(slurm_gpus, set_("models.actor.tensor_parallel", 3)),
        ["models.actor.tensor_parallel: must divide cluster.group.gpus_per_node (8) (got 3"],
    ),
    (
        "tp-pp-not-dividing-group",
        seq(
            slurm_gpus,
            set_("models.actor.engine", "megatron"),
            set_("models.actor.tensor_parallel", 4),
            set_("models.actor.pipeline_parallel", 4),
        ),
        [
            "models.actor: tensor_parallel·pipeline_parallel = 4·4 = 16 must divide the GPUs of cluster.group (8",
            "(got 16;",
        ],
    ),
    (
        "het-tp-not-dividing-trainer",
        seq(
            het,
            set_("cluster.backend", "slurm"),
            set_("cluster.trainer.gpus_per_node", 4),
            set_("models.actor.tensor_parallel", 8),
        ),
        ["models.actor.tensor_parallel: must divide cluster.trainer.gpus_per_node (4) (got 8"],
    ),
    (
        "separated-rollout-leaves-odd-gpus",
        seq(
            slurm_gpus,
            set_("rollout.mode", "separated"),
            set_("rollout.engines.count", 2),
            set_("models.actor.tensor_parallel", 4),
        ),
        [
            "models.actor: tensor_parallel·pipeline_parallel = 4·1 = 4 must divide the GPUs of cluster.group (6 left after the rollout engines' GPUs)"
        ],
    ),
    (
        "teacher-tp-not-dividing",
        seq(slurm_gpus, set_("models.teachers.1.tensor_parallel", 5)),
        ["models.teachers[1].tensor_parallel: must divide cluster.group.gpus_per_node (8) (got 5"],
    ),
    (
        "tp-on-cpu",
        set_("models.teachers.0.tensor_parallel", 2),
        [
            "models.teachers[0].tensor_parallel: tensor parallelism needs GPUs, but cluster.group.gpus_per_node is 0 (got 2"
        ],
    ),
    (
        "rollout-tp-not-dividing",
        seq(slurm_gpus, set_("rollout.engines.tensor_parallel", 3)),
        ["rollout.engines.tensor_parallel: must divide cluster.group.gpus_per_node (8) (got 3"],
    ),
    (
        "rollout-engines-exceed-gpus",
        seq(slurm_gpus, set_("rollout.engines.count", 5), set_("rollout.engines.tensor_parallel", 2)),
        [
            "rollout.engines.count: count·tensor_parallel = 5·2 exceeds the 8 GPUs of cluster.group (got 5; at most 4)"
        ],
    ),
    (
        "separated-rollout-takes-every-gpu",
        seq(slurm_gpus, set_("rollout.mode", "separated"), set_("rollout.engines.count", 8)),
        ["rollout.engines: rollout engines take all 8 GPUs of cluster.group, none left for the actor (got 8"],
    ),
    (
        "colocated-not-forked",
        set_("rollout.forked", False),
        [
            "rollout.forked: a colocated rollout must run as a forked child of the guard (got false; set "
            "rollout.forked: true (or leave it out: the default))"
        ],
    ),
    (
        "mask-low-ge-high",
        seq(set_("loss.correction", "mask"), set_("loss.mask_low", 2.0), set_("loss.mask_high", 2.0)),
        ["loss.mask_low: mask_low (2.0) must be < mask_high (2.0) for correction 'mask' (got 2.0"],
    ),
    (
        "weighted-without-weights",
        drop("data.sources.0.weight"),
        ["data.sources[0].weight: mixture 'weighted' needs a weight on every source (got null"],
    ),
    (
        "weights-on-proportional",
        # sources[0]'s weight (0.3 in the base) is refused as well
        seq(set_("data.mixture", "proportional"), set_("data.sources.1.weight", 3)),
        [
            "data.sources[1].weight: weights apply only to mixture 'weighted' (mixture is 'proportional') (got 3.0"
        ],
    ),
    (
        "awex-with-hf-rollout-tp2",
        seq(set_("weight_sync.backend", "awex"), set_("rollout.engines.tensor_parallel", 2)),
        [
            "rollout.engines.tensor_parallel: the HF rollout engine's AWEX reader (engines/weight_sync/awex_hf.py) is one "
            "process (got 2; expected 1, or rollout.backend: sglang)"
        ],
    ),
    (
        "awex-with-torch-actor",
        set_("weight_sync.backend", "awex"),
        [
            "weight_sync.backend: the AWEX writer needs a megatron actor; models.actor.engine is 'torch' (got 'awex'"
        ],
    ),
    (
        "awex-mode-mismatch",
        seq(set_("weight_sync.backend", "awex"), set_("weight_sync.awex_mode", "separate")),
        [
            "weight_sync.awex_mode: does not match rollout.mode 'colocated' (got 'separate'; 'colocate', or null"
        ],
    ),
    (
        "awex-mode-on-torch",
        set_("weight_sync.awex_mode", "colocate"),
        ["weight_sync.awex_mode: applies only to backend 'awex' (backend is 'torch') (got 'colocate'"],
    ),
    (
        "het-missing-group",
        set_("cluster.shape", "heterogeneous"),
        ["cluster.trainer: required for shape 'heterogeneous' (got null"],
    ),
    (
        "het-missing-rollout-group",
        seq(het, drop("cluster.rollout")),
        ["cluster.rollout: required for shape 'heterogeneous' (got null"],
    ),
    (
        "colocated-with-trainer-group",
        set_("cluster.trainer", {"nodes": 1}),
        ["cluster.trainer: set, but shape 'colocated' has no such group"],
    ),
    (
        "gpus-on-local-het",
        seq(het, set_("cluster.trainer.gpus_per_node", 2)),
        [
            "cluster.trainer.gpus_per_node: a local heterogeneous job runs both groups on this one machine, on CPU "
            "(got 2; set 0, or shape: colocated (one group on this machine's GPUs), or cluster.backend: slurm)"
        ],
    ),
    (
        "megatron-on-cpu",
        set_("models.actor.engine", "megatron"),
        [
            "models.actor.engine: the megatron engine needs GPUs, but cluster.group.gpus_per_node is 0 (got 'megatron'"
        ],
    ),
    (
        "megatron-teacher-on-cpu",
        set_("models.teachers.1.engine", "megatron"),
        ["models.teachers[1].engine: the megatron engine needs GPUs", "(got 'megatron'"],
    ),
    (
        "sglang-on-cpu",
        set_("rollout.backend", "sglang"),
        [
            "rollout.backend: the sglang backend needs GPUs, but cluster.group.gpus_per_node is 0 (got 'sglang'"
        ],
    ),
    (
        "het-with-colocated-rollout",
        seq(het, set_("rollout.mode", "colocated")),
        ["rollout.mode: a heterogeneous job puts the rollout on its own group (got 'colocated'"],
    ),
    (
        "torch-pipeline-parallel",
        set_("models.actor.pipeline_parallel", 2),
        [
            "models.actor.pipeline_parallel: the torch engine has no pipeline parallelism (got 2; use 1, or engine: megatron)"
        ],
    ),
    (
        "kl-without-rl",
        set_("loss.kl_coefficient", 0.1),
        ["loss.kl_coefficient: the KL penalty lives inside L_RL, which is off", "(got 0.1"],
    ),
    (
        "grpo-group-of-one",
        set_("loss.rl_coefficient", 1.0),
        [
            "data.samples_per_prompt: GRPO's group-normalized reward needs at least 2 samples per prompt",
            "(got 1",
        ],
    ),
    (
        "eval-overlaps-training",
        seq(set_("steps", 200), set_("data.batch_size", 64), set_("data.eval.seed", 100)),
        [
            "data.eval.seed: held-out items [100, 300) overlap the training items [0, 12800) (got 100; a seed ≥ 12800)"
        ],
    ),
    (
        "warmup-whole-run",
        set_("models.actor.optimizer.warmup_ratio", 1.0),
        ["models.actor.optimizer.warmup_ratio:", "(got 1.0"],
    ),
    (
        "schedule-unknown",
        set_("models.actor.optimizer.schedule", "exponential"),
        ["models.actor.optimizer.schedule:", "(got 'exponential'"],
    ),
    (
        "signal-after-time-limit",
        set_("cluster.time_min", 2),
        ["cluster.signal: fires 120 s before the end of a 2-minute job", "(got 'B:USR2@120'"],
    ),
    (
        "signal-malformed",
        set_("cluster.signal", "USR2@@1"),
        ["cluster.signal: not a Slurm --signal value: 'USR2@@1'"],
    ),
    (
        "sbatch-managed-option",
        set_("cluster.extra_sbatch", ["--exclusive", "--time=10"]),
        [
            "cluster.extra_sbatch[1]: --time is set by the config (got '--time=10'; set cluster.time_min instead)"
        ],
    ),
    (
        "sbatch-short-managed-option",
        set_("cluster.extra_sbatch", ["-pdebug"]),
        [
            "cluster.extra_sbatch[0]: -p is set by the config (got '-pdebug'; set cluster.<group>.partition instead)"
        ],
    ),
    (
        "sbatch-not-an-option",
        set_("cluster.extra_sbatch", ["--exclusive\n#SBATCH --time=1"]),
        ["cluster.extra_sbatch[0]: not one sbatch option (got '--exclusive\\n#SBATCH --time=1'"],
    ),
    (
        "rg-unknown-task",
        set_("data.sources.0.task", "chain_summ"),
        ["data.sources[0].task: unknown reasoning-gym task (got 'chain_summ'; did you mean 'chain_sum'"],
    ),
    (
        "rg-unknown-arg",
        set_("data.sources.1.task_args.max_animalz", 3),
        [
            "data.sources[1].task_args.max_animalz: unknown argument of task 'leg_counting' (got 'max_animalz'; known: min_animals, max_animals"
        ],
    ),
    (
        "rg-reserved-arg",
        set_("data.sources.0.task_args.seed", 7),
        ["data.sources[0].task_args.seed: set by mopd_hpc", "(got 7; remove it)"],
    ),
    (
        "rg-rejected-args",
        set_("data.sources.0.task_args.min_terms", 9),
        [
            "data.sources[0].task_args: rejected by reasoning-gym's ChainSumConfig: max_terms must be >= min_terms",
            "'min_terms': 9",
        ],
    ),
    # --- pydantic field-error families ------------------------------------------------------------
    ("missing-key", drop("steps"), ["steps: required key is missing (expected: Training steps"]),
    (
        "missing-nested-key",
        drop("models.actor.optimizer.lr"),
        ["models.actor.optimizer.lr: required key is missing (expected: Peak learning rate"],
    ),
    (
        "unknown-key",
        set_("models.actor.tp", 2),
        [
            "models.actor.tp: unknown key (got 2; known: id, path, dtype, engine, tensor_parallel, pipeline_parallel, "
            "expert_parallel, collective_timeout_s, optimizer, micro_batch_tokens, activation_checkpointing)"
        ],
    ),
    (
        "unknown-key-suggestion",
        set_("loss.corection", "mask"),
        ["loss.corection: unknown key (got 'mask';", "did you mean 'correction'?"],
    ),
    (
        "unknown-top-level-key",
        set_("trainer", {}),
        ["trainer: unknown key (got {};", "known: name, run_dir, seed"],
    ),
    (
        "unknown-key-in-source",
        set_("data.sources.0.path", "x.jsonl"),
        [
            "data.sources[0].path: unknown key (got 'x.jsonl'; known: kind, name, route, weight, template, "
            "system_prompt, chat_template_kwargs, reward, reward_pattern, task, task_args)"
        ],
    ),
    (
        "literal",
        set_("rollout.backend", "vllm"),
        ["rollout.backend: unknown value (got 'vllm'; known: 'hf' or 'sglang')"],
    ),
    (
        "literal-correction",
        set_("loss.correction", "clip"),
        ["loss.correction: unknown value (got 'clip'; known: 'truncate', 'mask' or 'none')"],
    ),
    (
        "wrong-type-int",
        set_("data.batch_size", "many"),
        ["data.batch_size: wrong type (got 'many'; expected an integer)"],
    ),
    (
        "wrong-type-fraction",
        set_("data.batch_size", 2.5),
        ["data.batch_size: wrong type (got 2.5; expected a whole number)"],
    ),
    (
        "wrong-type-bool",
        set_("rollout.forked", "maybe"),
        ["rollout.forked: wrong type (got 'maybe'; expected true or false)"],
    ),
    (
        "wrong-type-section",
        set_("models.actor.optimizer", None),
        ["models.actor.optimizer: wrong type (got null; expected a mapping)"],
    ),
    (
        "wrong-type-list",
        set_("models.teachers", {"id": "x"}),
        ["models.teachers: wrong type (got {'id': 'x'}; expected a list)"],
    ),
    ("range-ge", set_("data.batch_size", 0), ["data.batch_size: must be greater than or equal to 1 (got 0)"]),
    (
        "range-gt",
        set_("rollout.sampling.temperature", 0.0),
        ["rollout.sampling.temperature: must be greater than 0 (got 0.0)"],
    ),
    (
        "range-le",
        set_("rollout.sampling.top_p", 1.5),
        ["rollout.sampling.top_p: must be less than or equal to 1 (got 1.5)"],
    ),
    (
        "infinite-lr",
        set_("models.actor.optimizer.lr", float("inf")),
        ["models.actor.optimizer.lr:", "finite number", "got inf"],
    ),
    ("too-short-list", set_("models.teachers", []), ["models.teachers:", "at least 1 item", "(got [])"]),
    (
        "bad-identifier",
        set_("name", "my run"),
        ["name: not a valid name (got 'my run'; expected an identifier"],
    ),
    (
        "bad-route-name-key",
        set_("routes", {"chain": {"chain": 1.0}, "legs": {"legs": 1.0}, "my route": {"legs": 1.0}}),
        ["routes.my route (key): not a valid name (got 'my route'"],
    ),
    (
        "unknown-source-kind",
        set_("data.sources.0.kind", "csv"),
        ["data.sources[0].kind: unknown kind (got 'csv'; known: 'reasoning_gym', 'jsonl')"],
    ),
    (
        "missing-source-kind",
        drop("data.sources.1.kind"),
        ["data.sources[1].kind: required key is missing (one of 'reasoning_gym', 'jsonl')"],
    ),
    (
        "jsonl-missing-path",
        set_("data.sources.0", {"kind": "jsonl", "name": "mine", "route": "chain"}),
        ["data.sources[0].path: required key is missing (expected: Path of the .jsonl file"],
    ),
    (
        "empty-string",
        set_("models.actor.path", ""),
        ["models.actor.path:", "at least 1 character", "(got '')"],
    ),
]


@pytest.mark.parametrize(("mutate", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_config_names_path_and_value(
    tmp_path: Path, mutate: Callable[[dict[str, Any]], None], expected: list[str]
) -> None:
    lines = problems_of(tmp_path, mutate)
    assert any(all(s in line for s in expected) for line in lines), "\n".join(lines)


def test_at_least_25_distinct_bad_configs() -> None:
    assert len({c[0] for c in CASES}) == len(CASES) >= 25


def test_every_problem_is_listed_at_once(tmp_path: Path) -> None:
    """Field errors in one section do not hide field errors or cross-section rules of the others."""
    lines = problems_of(
        tmp_path,
        seq(
            set_("data.batch_size", 0),
            set_("routes.chain", {"reasoner": 1.0}),
            set_("rollout.forked", False),
            set_("loss.rl_coefficient", -1.0),
        ),
    )
    assert lines == [
        "data.batch_size: must be greater than or equal to 1 (got 0)",
        "loss.rl_coefficient: must be greater than or equal to 0 (got -1.0)",
        "rollout.forked: a colocated rollout must run as a forked child of the guard "
        "(got false; set rollout.forked: true (or leave it out: the default))",
        "routes.chain: unknown teacher 'reasoner' (known: chain, legs)",
    ]


def test_cross_section_rules_all_reported_together(tmp_path: Path) -> None:
    lines = problems_of(
        tmp_path,
        seq(
            set_("weight_sync.backend", "awex"),
            set_("data.sources.1.route", "mth"),
            set_("loss.kl_coefficient", 1.0),
        ),
    )
    assert len(lines) == 4  # weight_sync.backend: the AWEX writer needs a megatron actor
    assert {line.split(":")[0] for line in lines} == {
        "weight_sync.backend",
        "data.sources[1].route",
        "routes.legs",
        "loss.kl_coefficient",
    }


def test_yaml_syntax_error_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nroutes: {chain: [1.0\nsteps: 3\n")
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    (problem,) = info.value.problems
    assert problem.render().startswith("YAML syntax error at line 3, column")


def test_duplicate_yaml_key_is_an_error(tmp_path: Path) -> None:
    text = (
        (REPO / "configs" / "local_cpu.yaml")
        .read_text()
        .replace("  legs: {legs: 1.0}", "  legs: {legs: 1.0}\n  chain: {legs: 1.0}")
    )
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    lines = [p.render() for p in info.value.problems]
    assert len(lines) == 1 and lines[0].startswith("routes.chain: duplicate key (lines ")
    assert "YAML would silently keep the last" in lines[0]


@pytest.mark.parametrize(
    ("text", "expected"), [("", "got 'an empty document'"), ("- a\n- b\n", "got 'list'")]
)
def test_document_must_be_a_mapping(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "odd.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="a run config is a mapping of sections") as info:
        load_run_config(path)
    assert expected in str(info.value)


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_run_config(tmp_path / "nope.yaml")
    assert f"cannot read the config file: No such file or directory (got '{tmp_path / 'nope.yaml'}')" in str(
        info.value
    )


def test_config_error_is_a_value_error_with_one_line_per_problem(tmp_path: Path) -> None:
    lines = problems_of(tmp_path, seq(set_("steps", 0), set_("seed", -1)))
    with pytest.raises(ValueError) as info:
        RunConfig.from_dict({**BASE, "steps": 0, "seed": -1}, source="inline")
    assert str(info.value).splitlines() == ["inline: 2 problems", *(f"  - {line}" for line in lines)]


def test_loss_config_alone_still_rejects_both_coefficients_zero() -> None:
    """The loss section's own validator (used by the MOPD core without a RunConfig)."""
    with pytest.raises(ValueError, match="distillation_coefficient and rl_coefficient are both 0"):
        LossConfig(distillation_coefficient=0.0, rl_coefficient=0.0, orm_alpha=1.0)
    assert LossConfig(distillation_coefficient=0.0, rl_coefficient=1.0).rl_coefficient == 1.0
