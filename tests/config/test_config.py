"""The run config: shipped configs validate, YAML round trip, `--set` overrides, resolution, queries."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from mopd_hpc.config import (
    ConfigError,
    JsonlSource,
    ReasoningGymSource,
    RunConfig,
    apply_overrides,
    load_run_config,
)
from mopd_hpc.config.overrides import parse_key
from mopd_hpc.config.types import IDENTIFIER_PATTERN

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
BASE: dict[str, Any] = yaml.safe_load((REPO / "configs" / "local_cpu.yaml").read_text())


# ------------------------------------------------------------------------------------ shipped configs


def test_the_three_configs_of_the_brief_exist() -> None:
    names = {p.name for p in CONFIGS}
    assert {"local_cpu.yaml", "slurm_het_cpu.yaml", "gsm8k_qwen3_14b_to_0_6b.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_validates_and_round_trips(path: Path) -> None:
    cfg = RunConfig.from_yaml(path)
    assert RunConfig.from_yaml_text(cfg.to_yaml()) == cfg
    assert RunConfig.from_yaml(cfg.to_yaml()) == cfg  # text (it has newlines) as well as a path
    # the only warnings a shipped config may carry: what the job's roles do not run yet (production engines),
    # that the sglang backend has run with a stand-in for its engine only, and (the local one-GPU config) that
    # sglang does not import here, its version checked by the role at rollout start
    known = (
        "not run by the job's roles yet: ",
        "rollout.backend: the sglang backend has been tested with a stand-in",
        "rollout.backend: the sglang backend's package 'sglang' does not import on this machine",
    )
    assert [w for w in cfg.warnings() if not w.startswith(known)] == []


def test_local_cpu_is_the_embedded_default() -> None:
    cfg = RunConfig.from_yaml(REPO / "configs" / "local_cpu.yaml")
    assert (cfg.cluster.backend, cfg.cluster.shape) == ("local", "colocated")
    assert cfg.cluster.group is not None and cfg.cluster.group.gpus_per_node == 0
    assert cfg.cluster.trainer_group is cfg.cluster.rollout_group is cfg.cluster.group
    assert (cfg.models.actor.id, cfg.models.actor.engine) == ("student", "torch")
    assert cfg.models.teacher_ids == ("chain", "legs")
    assert cfg.models.teacher("chain").path == ".cache/models/teacher_chain_sum"
    assert (cfg.rollout.backend, cfg.weight_sync.backend) == ("hf", "torch")
    assert cfg.route_weights("chain") == {"chain": 1.0} and cfg.route_weights("legs") == {"legs": 1.0}
    assert cfg.used_route_weights() == {"chain": {"chain": 1.0}, "legs": {"legs": 1.0}}
    chain, legs = cfg.data.sources
    assert isinstance(chain, ReasoningGymSource) and isinstance(legs, ReasoningGymSource)
    assert (chain.task, chain.route, chain.task_args) == (
        "chain_sum",
        "chain",
        {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1},
    )
    assert (legs.task, legs.route, legs.task_args) == (
        "leg_counting",
        "legs",
        {"min_animals": 1, "max_animals": 2, "max_instances": 5},
    )
    assert (cfg.loss.distillation_coefficient, cfg.loss.rl_coefficient, cfg.loss.orm_alpha) == (1.0, 0.0, 0.0)
    # the SFT-then-MOPD recipe (README "Distillation fidelity"): half the steps SFT on the teachers' answers
    assert (cfg.steps, cfg.loss.sft_warmup_ratio, cfg.loss.sft_steps(cfg.steps)) == (1800, 0.5, 900)
    # 30 % of the prompts chain, 70 % legs: the student's harder route (README "Distillation fidelity")
    assert (cfg.data.mixture, [s.weight for s in cfg.data.sources]) == ("weighted", [0.3, 0.7])


def test_slurm_het_cpu_shape() -> None:
    cfg = RunConfig.from_yaml(REPO / "configs" / "slurm_het_cpu.yaml")
    assert (cfg.cluster.backend, cfg.cluster.shape) == ("slurm", "heterogeneous")
    trainer, rollout = cfg.cluster.trainer, cfg.cluster.rollout
    assert trainer is not None and rollout is not None and cfg.cluster.group is None
    assert (trainer.nodes, rollout.nodes) == (1, 2)
    assert (trainer.partition, rollout.partition) == ("debug", "debug")
    assert trainer.gpus_per_node == rollout.gpus_per_node == 0
    assert list(cfg.cluster.groups()) == ["trainer", "rollout"]
    assert cfg.cluster.signal == "B:USR2@120" and cfg.cluster.signal_lead_s == 120
    assert cfg.models.tokenizer.path == cfg.models.actor.path == ".cache/models/student"  # resolved default


def test_gsm8k_production_shape() -> None:
    cfg = RunConfig.from_yaml(REPO / "configs" / "gsm8k_qwen3_14b_to_0_6b.yaml")
    actor, (teacher,) = cfg.models.actor, cfg.models.teachers
    assert (actor.path, actor.engine, actor.tensor_parallel) == ("Qwen/Qwen3-0.6B", "megatron", 8)
    assert (teacher.path, teacher.engine) == ("Qwen/Qwen3-14B", "megatron")
    assert (cfg.rollout.backend, cfg.weight_sync.backend, cfg.weight_sync.awex_mode) == (
        "hf",
        "awex",
        "colocate",
    )
    assert cfg.cluster.backend == "slurm" and cfg.cluster.trainer_group.gpus_per_node == 8
    assert isinstance(cfg.data.sources[0], JsonlSource)


def test_local_flag_forces_the_local_backend() -> None:
    cfg = load_run_config(REPO / "configs" / "slurm_het_cpu.yaml", force_local=True)
    assert cfg.cluster.backend == "local"
    # a colocated GPU config runs locally on this machine's GPUs (launch.local_gpus checks the count at submit)
    gpu = load_run_config(REPO / "configs" / "gsm8k_qwen3_14b_to_0_6b.yaml", force_local=True)
    assert gpu.cluster.backend == "local" and gpu.cluster.group.gpus_per_node == 8


# ------------------------------------------------------------------------------------ resolution


def test_tokenizer_defaults_to_the_actor_path() -> None:
    d = copy.deepcopy(BASE)
    del d["models"]["tokenizer"]
    cfg = RunConfig.from_dict(d)
    assert cfg.models.tokenizer.path == ".cache/models/student"
    assert "tokenizer:\n    path: .cache/models/student" in cfg.to_yaml()


def test_awex_mode_follows_rollout_mode_when_null() -> None:
    d = yaml.safe_load((REPO / "configs" / "gsm8k_qwen3_14b_to_0_6b.yaml").read_text())
    d["weight_sync"]["awex_mode"] = None
    assert RunConfig.from_dict(d).weight_sync.awex_mode == "colocate"


def test_defaults_fill_omitted_sections() -> None:
    d = copy.deepcopy(BASE)
    del d["loss"], d["weight_sync"], d["data"]["eval"]
    cfg = RunConfig.from_dict(d)
    assert cfg.loss.correction == "truncate" and cfg.loss.ratio_cap == 5.0 and cfg.loss.advantage_clip is None
    assert cfg.weight_sync.backend == "torch"
    assert (cfg.data.eval.size, cfg.data.eval.seed) == (200, 10_000_000)


def test_config_is_frozen() -> None:
    cfg = RunConfig.from_dict(BASE)
    with pytest.raises(ValidationError, match="frozen"):
        cfg.steps = 3  # type: ignore[misc]
    with pytest.raises(KeyError, match="unknown route 'x' \\(known: chain, legs\\)"):
        cfg.route_weights("x")
    with pytest.raises(KeyError, match="unknown teacher 'x' \\(known: chain, legs\\)"):
        cfg.models.teacher("x")


def test_every_field_is_documented() -> None:
    """STYLE.md rule 2: every knob carries a description where it is declared."""
    from pydantic import BaseModel

    from mopd_hpc.config import schema

    seen: set[type] = set()

    def walk(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            tp = schema.strip(field.annotation)
            for candidate in (tp, *schema.union_members(tp), *getattr(tp, "__args__", ())):
                for inner in (schema.strip(candidate), *schema.union_members(schema.strip(candidate))):
                    if isinstance(inner, type) and issubclass(inner, BaseModel):
                        walk(inner)

    walk(RunConfig)
    assert len(seen) >= 15


def test_unused_teacher_is_a_warning_not_an_error() -> None:
    cfg = load_run_config(
        REPO / "configs" / "local_cpu.yaml",
        ["routes.legs={legs: 1.0, chain: 0}", "routes.chain.legs=1", "routes.chain.chain=0"],
    )
    assert cfg.warnings() == [
        "models.teachers[0]: teacher 'chain' has no weight > 0 in any route: it contributes nothing "
        "(remove it, or give it a weight)"
    ]


# ------------------------------------------------------------------------------------ overrides


def test_overrides_parse_yaml_values_and_create_sections() -> None:
    d = yaml.safe_load((REPO / "configs" / "slurm_het_cpu.yaml").read_text())
    d.pop("loss", None)  # overrides must create a missing section
    out = apply_overrides(
        d,
        [
            "loss.correction=mask",
            "loss.advantage_clip=5",
            "models.actor.optimizer.lr=1e-4",
            "cluster.requeue=false",
            "cluster.extra_sbatch=[--exclusive, --constraint=cpu]",
            "data.sources[1].route=chain",
            "data.sources.0.task_args.max_terms=2",
            "routes.chain.legs=0.5",
            "name=a=b",
            "cluster.trainer.account=null",
        ],
    )
    assert out["loss"] == {"correction": "mask", "advantage_clip": 5}
    assert out["models"]["actor"]["optimizer"]["lr"] == 1e-4
    assert out["cluster"]["requeue"] is False
    assert out["cluster"]["extra_sbatch"] == ["--exclusive", "--constraint=cpu"]
    assert out["data"]["sources"][1]["route"] == "chain"
    assert out["data"]["sources"][0]["task_args"]["max_terms"] == 2
    assert out["routes"]["chain"] == {"chain": 1.0, "legs": 0.5}
    assert out["name"] == "a=b"  # only the first '=' splits
    assert out["cluster"]["trainer"]["account"] is None
    assert "loss" not in d and d["routes"]["chain"] == {"chain": 1.0}  # the input is not modified


def test_later_override_wins_and_validation_follows() -> None:
    cfg = load_run_config(REPO / "configs" / "local_cpu.yaml", ["steps=5", "steps=7", "loss.correction=none"])
    assert cfg.steps == 7 and cfg.loss.correction == "none"


def test_override_errors_name_the_path_and_known_keys() -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides(
            BASE,
            ["loss.corection=mask", "data.sources[5].route=x", "novalue", "a..b=1", "models.actor.id.x=1"],
        )
    assert [p.render() for p in info.value.problems] == [
        "--set loss.corection: unknown key (got 'corection'; known: estimator, topk, correction, ratio_cap, "
        "mask_low, mask_high, advantage_clip, normalizer, distillation_coefficient, rl_coefficient, orm_alpha, "
        "ppo_clip, kl_coefficient, sft_warmup_steps, sft_warmup_ratio, router_aux_loss_coefficient, "
        "router_z_loss_coefficient; did you mean 'correction'?)",
        "--set data.sources[5]: index out of range (got 5; the list has 2 items)",
        "--set novalue: expected KEY=VALUE (e.g. loss.correction=mask)",
        "--set a..b: malformed key 'a..b' at character 3 (a dotted path such as data.sources[0].route)",
        "--set models.actor.id.x: unknown key (got 'x'; known: none)",
    ]


def test_override_follows_the_source_kind() -> None:
    out = apply_overrides(
        BASE, ["data.sources[0]={kind: jsonl, name: mine, route: chain}", "data.sources[0].path=p.jsonl"]
    )
    assert out["data"]["sources"][0]["path"] == "p.jsonl"
    with pytest.raises(
        ConfigError, match=r"--set data.sources\[1\].path: unknown key \(got 'path'; known: kind, name"
    ):
        apply_overrides(BASE, ["data.sources[1].path=p.jsonl"])


@pytest.mark.parametrize(
    ("key", "parts"),
    [
        ("a", ["a"]),
        ("a.b", ["a", "b"]),
        ("a[1].b", ["a", 1, "b"]),
        ("a.1.b", ["a", 1, "b"]),
        ("a[-1]", ["a", -1]),
    ],
)
def test_parse_key(key: str, parts: list[str | int]) -> None:
    assert parse_key(key) == parts


@pytest.mark.parametrize("key", ["", ".a", "a.", "a..b", "a[x]", "a[1"])
def test_parse_key_rejects(key: str) -> None:
    with pytest.raises(ValueError, match="malformed key"):
        parse_key(key)


# ------------------------------------------------------------------------------------ round trip


identifiers = st.from_regex(IDENTIFIER_PATTERN, fullmatch=True).filter(lambda s: len(s) <= 64)
texts = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=40)
positive = st.floats(min_value=1e-12, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def run_configs(draw: st.DrawFn) -> dict[str, Any]:
    d = copy.deepcopy(BASE)
    d["name"] = draw(identifiers)
    d["run_dir"] = draw(texts)
    d["seed"] = draw(st.integers(0, 10**6))
    d["steps"] = draw(st.integers(1, 10**4))
    d["checkpoint_interval"] = draw(st.integers(1, 10**4))
    d["models"]["actor"]["path"] = draw(texts)
    d["models"]["actor"]["optimizer"] = {
        "lr": draw(positive),
        "weight_decay": draw(st.floats(0, 1)),
        "grad_clip": draw(st.none() | positive),
    }
    chain_id, legs_id = draw(
        st.lists(identifiers.filter(lambda s: s != "student"), min_size=2, max_size=2, unique=True)
    )
    d["models"]["teachers"][0]["id"], d["models"]["teachers"][1]["id"] = chain_id, legs_id
    d["routes"] = {
        "chain": {chain_id: draw(positive), legs_id: draw(st.floats(0, 10))},
        "legs": {legs_id: draw(positive)},
    }
    if draw(st.booleans()):
        del d["models"]["tokenizer"]
    d["data"]["mixture"] = draw(st.sampled_from(["proportional", "uniform", "weighted"]))
    for source in d["data"]["sources"]:
        source["weight"] = draw(positive) if d["data"]["mixture"] == "weighted" else None
    if draw(st.booleans()):
        d["data"]["sources"].append(
            {
                "kind": "jsonl",
                "name": "own",
                "path": draw(texts),
                "route": "legs",
                "weight": d["data"]["sources"][1]["weight"],
            }
        )
    low = draw(st.floats(0, 10))
    d["loss"] = {
        "correction": draw(st.sampled_from(["truncate", "mask", "none"])),
        "mask_low": low,
        "mask_high": low + draw(positive),
        "ratio_cap": draw(positive),
        "advantage_clip": draw(st.none() | positive),
        "normalizer": draw(st.sampled_from(["token-mean", "seq-mean-token-mean"])),
    }
    d["rollout"]["sampling"] = {
        "temperature": draw(positive),
        "top_p": draw(st.floats(1e-6, 1.0)),
        "max_new_tokens": draw(st.integers(1, 10**5)),
    }
    d["cluster"]["extra_sbatch"] = ["--constraint=" + draw(st.text("abc_&|", max_size=10))]
    d["cluster"]["time_min"] = draw(st.integers(3, 10**5))
    return d


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run_configs())
def test_yaml_round_trip(d: dict[str, Any]) -> None:
    cfg = RunConfig.from_dict(d)
    text = cfg.to_yaml()
    again = RunConfig.from_yaml_text(text)
    assert again == cfg
    assert again.to_yaml() == text
    assert again.models.actor.optimizer.lr == d["models"]["actor"]["optimizer"]["lr"]
    assert again.run_dir == d["run_dir"]
    assert math.isclose(sum(again.route_weights("chain").values()), sum(d["routes"]["chain"].values()))


@pytest.mark.parametrize("text", ["0E0", "1e-4", "-1_0e+5", "12", "true", "null"])
def test_strings_that_read_as_other_types_round_trip(text: str) -> None:
    """The loader reads `1e-4` as a float (YAML 1.2); the dumper must quote such strings (found by
    hypothesis: a model path '0E0' came back as 0.0)."""
    cfg = load_run_config(REPO / "configs" / "local_cpu.yaml", [f"models.actor.path={text!r}"])
    assert cfg.models.actor.path == text
    assert RunConfig.from_yaml_text(cfg.to_yaml()) == cfg


def test_round_trip_through_a_file(tmp_path: Path) -> None:
    cfg = RunConfig.from_yaml(REPO / "configs" / "gsm8k_qwen3_14b_to_0_6b.yaml")
    path = tmp_path / "resolved.yaml"
    path.write_text(cfg.to_yaml())
    assert RunConfig.from_yaml(path) == cfg
    assert load_run_config(path) == cfg


def test_yaml_round_trip_of_a_line_break_character_pyyaml_writes_raw() -> None:
    """U+0085 (NEL) in a path: PyYAML's unicode output reads back as a space; the dump escapes it."""
    from mopd_hpc.config.yaml_io import dump_yaml, load_yaml_text

    data = {"path": "x\x85y", "name": "蒸馏"}
    assert load_yaml_text(dump_yaml(data))[0] == data
    assert "蒸馏" in dump_yaml({"name": "蒸馏"})  # readable unicode where it round-trips


def test_a_bad_set_key_does_not_hide_the_other_problems() -> None:
    """Every problem at once: an unknown --set key, and the bad values the other --set items bring."""
    with pytest.raises(ConfigError) as err:
        load_run_config(
            REPO / "configs" / "local_cpu.yaml",
            ["loss.estimater=topk", "steps=abc", "loss.correction=maks", "data.batch_size=0"],
        )
    paths = sorted(p.path for p in err.value.problems)
    assert paths == ["--set loss.estimater", "data.batch_size", "loss.correction", "steps"]
