"""What `--check` keeps refusing of the megatron path (issue 18): pipeline_parallel > 1 (naming the field),
megatron at tensor_parallel > 1 or data-parallel > 1 on GPUs until a multi-GPU run has passed (the capability
limit alone), AWEX moving an MoE checkpoint's experts (configs/qwen3_coder_4node.yaml's Qwen3-Coder family)
where it has not run, and an architecture of no declared family, naming it. Oracle: the refusals' field, value and message.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mopd_hpc.config import ConfigError, load_run_config
from mopd_hpc.config.capabilities import ACTOR_ENGINES
from mopd_hpc.config.job_gaps import job_gaps, unverified_gaps, unverified_warning
from mopd_hpc.launch.model_check import prepare_models, unverified_model_warnings
from mopd_hpc.launch.moe_check import moe_actor_problems

REPO = Path(__file__).resolve().parents[2]
CODER = REPO / "configs" / "qwen3_coder_4node.yaml"


def test_pipeline_parallel_above_1_is_refused_naming_the_field() -> None:
    cfg = load_run_config(CODER, ["models.actor.pipeline_parallel=2"])
    pp = [p for p in job_gaps(cfg) if p.path == "models.actor.pipeline_parallel"]
    assert len(pp) == 1 and pp[0].got == 2
    assert "pipeline_parallel ≤ 1" in pp[0].message and pp[0].expected == "expected ≤ 1"


def test_megatron_tp_and_dp_stay_refused_by_the_capability_limit_only() -> None:
    spec = ACTOR_ENGINES["megatron"]
    assert (spec.tensor_parallel, spec.data_parallel_gpu) == (1, 1)  # until a run on 2+ GPUs has passed
    gaps = job_gaps(load_run_config(CODER))  # TP 4 × DP 8 on 32 GPUs
    fields = {p.path: p for p in gaps}
    assert fields["models.actor.tensor_parallel"].got == 4
    assert "data-parallel size ≤ 1" in fields["models.actor.engine"].message


def test_awex_from_several_trainer_ranks_names_the_test_that_has_not_run() -> None:
    """AWEX with every trainer rank a writer (trainer/rank_writer.py) is refused on GPUs beyond one trainer rank
    until tests/engines/test_awex_tp_gpu.py has run, naming it; one trainer rank and CPU groups are not refused by it."""
    from mopd_hpc.config.serving_refusals import weight_sync_refusals

    (problem,) = weight_sync_refusals("awex", "megatron", "hf", "colocated", "gpu", actor_world=2)
    assert problem.path == "weight_sync.backend" and problem.got == "awex"
    assert problem.message == (
        "the awex sync from 2 trainer ranks (every rank a writer at its transfer rank) has not run on GPUs: it "
        "has run from one trainer rank only, and tests/engines/test_awex_tp_gpu.py (a TP 2 actor: 2 GPUs colocated, "
        "4 separated) has not run"
    )
    assert problem.expected.startswith("one trainer slot")
    assert list(weight_sync_refusals("awex", "megatron", "hf", "colocated", "gpu", actor_world=1)) == []
    assert list(weight_sync_refusals("torch", "megatron", "hf", "separated", "gpu", actor_world=8)) == []


@pytest.fixture(scope="module")
def moe_checkpoint(micro_models: Path, tmp_path_factory) -> Path:
    """A tiny Qwen3MoeForCausalLM (2 experts) with the micro student's tokenizer files."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    root = tmp_path_factory.mktemp("moe")
    student = micro_models / "student"
    from transformers import AutoConfig

    size = AutoConfig.from_pretrained(student).vocab_size
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=size, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=2,
        num_experts_per_tok=1, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    out = root / "moe"
    Qwen3MoeForCausalLM(cfg).save_pretrained(str(out))
    for f in student.iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out


def test_an_moe_checkpoint_runs_on_megatron_and_awex_waits_for_its_separated_gpu_test(
    moe_checkpoint: Path,
) -> None:
    """A megatron MoE actor and teacher pass (benchmarks/moe_step.py ran on an H100); AWEX moving its experts
    is refused unverified where that has not run (separated, NCCL: 2 GPUs), naming the test and the opt-in,
    and passes colocated (CUDA IPC: tests/engines/test_awex_hf_gpu.py[colocate-qwen3_moe] ran)."""
    path = str(moe_checkpoint)
    overrides = [
        f"models.actor.path={path}",
        f"models.tokenizer.path={path}",
        f"models.teachers.0.path={path}",
    ]
    cfg = load_run_config(CODER, overrides)
    assert cfg.rollout.mode == "separated" and cfg.models.actor.engine == "megatron"
    assert unverified_model_warnings(prepare_models(cfg, str(CODER))) == []
    with pytest.raises(ConfigError) as err:
        prepare_models(load_run_config(CODER, [*overrides, "weight_sync.backend=awex"]), str(CODER))
    text = str(err.value)
    assert (
        f"weight_sync.backend: the actor ({path}) is a mixture-of-experts Qwen3MoeForCausalLM: awex has not moved "
        "experts on GPUs with rollout.mode separated (tests/engines/test_awex_hf_gpu.py[separate-qwen3_moe] "
        "(2 GPUs) has not run)" in text
    )
    assert "models.actor.path" not in text and "models.teachers[0].path" not in text
    assert "(got 'awex'; weight_sync.backend: torch, or allow_unverified: true (--allow-unverified)" in text
    # colocated, AWEX has moved a MoE's experts on a GPU: no refusal of its own
    awex = load_run_config(CODER, [*overrides, "weight_sync.backend=awex"])
    colocated = awex.model_copy(update={"rollout": awex.rollout.model_copy(update={"mode": "colocated"})})
    assert moe_actor_problems(colocated, "Qwen3MoeForCausalLM", moe_checkpoint) == []
    assert [p.path for p in moe_actor_problems(awex, "Qwen3MoeForCausalLM", moe_checkpoint)] == [
        "weight_sync.backend"
    ]
    # the opt-in lets AWEX's experts through, and --check warns for that field only
    opt_in = [*overrides, "allow_unverified=true", "weight_sync.backend=awex"]
    warnings = unverified_model_warnings(prepare_models(load_run_config(CODER, opt_in), str(CODER)))
    assert [w.split(" = ")[0] for w in warnings] == ["weight_sync.backend"]
    assert (
        "let through by allow_unverified" in warnings[0]
        and "test_awex_hf_gpu.py[separate-qwen3_moe]" in warnings[0]
    )
    # the torch engine loads a Qwen3-MoE checkpoint: no architecture refusal
    torch_cfg = load_run_config(
        CODER,
        [
            *overrides,
            "models.actor.engine=torch",
            "models.teachers.0.engine=torch",
            "weight_sync.backend=torch",
        ],
    )
    prepare_models(torch_cfg, str(CODER))


@pytest.mark.parametrize(
    ("architectures", "model_type", "torch_refused"),
    [
        (["LlamaForCausalLM"], "llama", None),
        (None, "llama", None),  # no `architectures`: the class of its model_type
        (["MistralForCausalLM"], "mistral", "MistralForCausalLM"),
        (None, "gemma3", "model_type 'gemma3'"),
    ],
)
def test_model_families_other_architectures_are_refused_naming_them(
    moe_checkpoint: Path, tmp_path: Path, architectures, model_type, torch_refused
) -> None:
    """config/capabilities.py MODEL_FAMILIES: Llama loads on the torch and megatron engines (a megatron Llama
    actor ran on an H100: benchmarks/moe_step.py --student llama); an architecture of no declared family is
    refused on either engine, named."""
    import json

    ckpt = tmp_path / "ckpt"
    shutil.copytree(moe_checkpoint, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["model_type"] = model_type
    config.pop("architectures")
    if architectures:
        config["architectures"] = architectures
    (ckpt / "config.json").write_text(json.dumps(config))
    overrides = [
        f"models.actor.path={ckpt}",
        f"models.tokenizer.path={ckpt}",
        f"models.teachers.0.path={ckpt}",
    ]
    if torch_refused is None:
        assert unverified_model_warnings(prepare_models(load_run_config(CODER, overrides), str(CODER))) == []
    else:
        with pytest.raises(ConfigError) as err:
            prepare_models(load_run_config(CODER, overrides), str(CODER))
        text = str(err.value)
        assert (
            f"is a {torch_refused}" in text
            and "models.actor.path" in text
            and "models.teachers[0].path" in text
        )
    torch_cfg = load_run_config(
        CODER,
        [
            *overrides,
            "models.actor.engine=torch",
            "models.teachers.0.engine=torch",
            "weight_sync.backend=torch",
        ],
    )
    if torch_refused is None:
        prepare_models(torch_cfg, str(CODER))
        return
    with pytest.raises(ConfigError) as err:
        prepare_models(torch_cfg, str(CODER))
    text = str(err.value)
    assert (
        "the job's engines load Qwen3ForCausalLM / Qwen3MoeForCausalLM / LlamaForCausalLM checkpoints only "
        f"(config/capabilities.py MODEL_FAMILIES); {ckpt} is a {torch_refused}" in text
    )


def test_router_losses_are_refused_for_a_dense_actor(moe_checkpoint: Path, micro_models: Path) -> None:
    """loss.router_* act on a mixture-of-experts actor's routers: for a dense one `--check` refuses them."""
    dense = micro_models / "student"
    torch_engines = [
        "models.actor.engine=torch",
        "models.teachers.0.engine=torch",
        "weight_sync.backend=torch",
    ]
    for actor, refused in ((dense, True), (moe_checkpoint, False)):
        overrides = [
            f"models.actor.path={actor}",
            f"models.tokenizer.path={actor}",
            f"models.teachers.0.path={actor}",
            "loss.router_z_loss_coefficient=0.01",
            "loss.router_aux_loss_coefficient=0.001",
            *torch_engines,
        ]
        cfg = load_run_config(CODER, overrides)
        if not refused:
            prepare_models(cfg, str(CODER))
            continue
        with pytest.raises(ConfigError) as err:
            prepare_models(cfg, str(CODER))
        text = str(err.value)
        for field in ("loss.router_z_loss_coefficient", "loss.router_aux_loss_coefficient"):
            assert f"{field}: the actor ({dense}) is a dense Qwen3ForCausalLM: it has no router" in text


def test_moe_settings_the_engines_do_not_run_are_refused_naming_the_field() -> None:
    """rollout.routing_replay (sglang rollout) through job_gaps: config/capabilities.py moe_refusals; the
    expert-parallel size: `test_expert_parallel_is_unverified_where_written_and_refused_where_it_cannot_run`."""
    cfg = load_run_config(
        CODER,
        ["rollout.routing_replay=true", "loss.router_z_loss_coefficient=0.01", "rollout.backend=sglang"],
    )
    gaps = [p for p in job_gaps(cfg) if p.path == "rollout.routing_replay"]
    gaps += [p for p in job_gaps(cfg) if p.path.startswith("loss.router")]
    text = "\n".join(f"{p.path}: {p.message} ({p.expected})" for p in gaps)
    assert "the megatron actor engine does not replay" not in text  # it does (routing_replay.py)
    assert "rollout.routing_replay: the sglang rollout backend does not answer the routed experts" in text
    assert "loss.router_z_loss_coefficient" not in text  # megatron adds the router losses
    with pytest.raises(
        ConfigError, match="rollout.compile_decode: rollout.routing_replay records the routed"
    ):
        load_run_config(CODER, ["rollout.routing_replay=true", "rollout.backend=hf"])


def _ep_gaps(overrides: list[str]) -> tuple[list, list]:
    """(refusals, refusals let through by the opt-in) of models.actor.expert_parallel for CODER + overrides."""
    cfg = load_run_config(CODER, overrides)
    pick = lambda ps: [p for p in ps if p.path == "models.actor.expert_parallel"]  # noqa: E731
    return pick(job_gaps(cfg)), pick(unverified_gaps(cfg))


def test_expert_parallel_is_unverified_where_written_and_refused_where_it_cannot_run() -> None:
    """The megatron actor's EP > 1 (engines/megatron/expert_parallel.py, run on CPU only) is refused as
    unverified, naming the 2-GPU test and the opt-in, and lets through with it (a warning); what cannot run is
    refused with or without it, naming the field, the value and the way out: EP not dividing the DP size,
    tensor_parallel > 1, the KL penalty, AWEX, the torch engine."""
    tp1 = ["models.actor.tensor_parallel=1"]  # CODER: 32 trainer GPUs, TP 4; at TP 1 DP 32
    (ep,), through = _ep_gaps([*tp1, "models.actor.expert_parallel=2"])
    assert ep.got == 2 and ep.unverified == "tests/engines/test_megatron_ep_gpu.py (2 GPUs)" and not through
    assert "has not run on GPUs (tests/engines/test_megatron_ep_gpu.py (2 GPUs))" in ep.message
    assert (
        ep.expected
        == "expert_parallel: 1, or allow_unverified: true (--allow-unverified) to run it unverified"
    )
    refused, (warned,) = _ep_gaps([*tp1, "models.actor.expert_parallel=2", "allow_unverified=true"])
    assert refused == [] and warned == ep
    assert unverified_warning(warned).startswith("models.actor.expert_parallel = 2 (not run on GPUs here")
    cases = {
        "models.actor.expert_parallel=3": (
            "3 does not divide the actor's data-parallel size 32 (its 32 trainer ranks / (tensor_parallel 1",
            "a divisor of 32, or more trainer GPUs",
        ),
        "models.actor.tensor_parallel=4": (
            "expert_parallel 2 with models.actor.tensor_parallel 4: every expert is gathered over the EP group "
            "at tensor_parallel 1 only",
            "tensor_parallel: 1, or expert_parallel: 1",
        ),
        "loss.kl_coefficient=0.1": ("expert_parallel 2 with loss.kl_coefficient 0.1", "kl_coefficient: 0"),
        "weight_sync.backend=awex": ("expert_parallel 2 with weight_sync.backend awex", "torch or ipc"),
        "models.actor.engine=torch": (
            "the actor role runs the torch engine at expert_parallel ≤ 1",
            "expected ≤ 1, or models.actor.engine: megatron",
        ),
    }
    for override, (message, way) in cases.items():
        extra = ["loss.rl_coefficient=1"] if override.startswith("loss.kl") else []
        for opt_in in ([], ["allow_unverified=true"]):
            base = [*tp1, "models.actor.expert_parallel=2", *extra, override, *opt_in]
            refused, _ = _ep_gaps(base)
            assert any(message in p.message and way in p.expected and not p.unverified for p in refused), (
                override,
                [(p.message, p.expected) for p in refused],
            )


def test_routing_replay_and_expert_parallel_are_refused_for_a_dense_actor(
    moe_checkpoint: Path, micro_models: Path
) -> None:
    dense = micro_models / "student"
    overrides = [
        f"models.actor.path={dense}",
        f"models.tokenizer.path={dense}",
        f"models.teachers.0.path={dense}",
        "models.actor.engine=torch",
        "models.teachers.0.engine=torch",
        "weight_sync.backend=torch",
        "rollout.routing_replay=true",
        "models.actor.expert_parallel=2",
    ]
    with pytest.raises(ConfigError) as err:
        prepare_models(load_run_config(CODER, overrides), str(CODER))
    text = str(err.value)
    assert (
        f"rollout.routing_replay: the actor ({dense}) is a dense Qwen3ForCausalLM: it has no routed experts"
        in text
    )
    assert f"models.actor.expert_parallel: the actor ({dense}) is a dense Qwen3ForCausalLM" in text


def test_a_rope_scaling_megatron_does_not_compute_is_refused_at_check(
    moe_checkpoint: Path, tmp_path: Path
) -> None:
    """launch/rope_check.py: a megatron Llama checkpoint whose config.json asks for yarn RoPE scaling is refused
    by --check naming the field and the value (megatron-core computes llama3's only); llama3 passes."""
    import json

    ckpt = tmp_path / "llama"
    shutil.copytree(moe_checkpoint, ckpt)
    config = json.loads((ckpt / "config.json").read_text()) | {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
    }
    overrides = [f"models.actor.path={ckpt}", f"models.tokenizer.path={ckpt}", f"models.teachers.0.path={ckpt}",
                 "allow_unverified=true", "weight_sync.backend=torch"]  # fmt: skip
    for scaling, refused in (
        ({"rope_type": "yarn", "factor": 4.0}, True),
        ({"rope_type": "llama3", "factor": 8.0}, False),
    ):
        (ckpt / "config.json").write_text(json.dumps(config | {"rope_scaling": scaling}))
        if not refused:
            prepare_models(load_run_config(CODER, overrides), str(CODER))
            continue
        with pytest.raises(ConfigError) as err:
            prepare_models(load_run_config(CODER, overrides), str(CODER))
        text = str(err.value)
        assert (
            f"models.actor.path: {ckpt}/config.json: rope_type='yarn': the megatron engine applies no RoPE"
            in text
        )
        assert "models.teachers[0].path" in text


def test_awex_refuses_an_actor_family_it_has_no_converter_for(moe_checkpoint: Path, tmp_path: Path) -> None:
    """launch/moe_check.py sync_family_problems: AWEX converts the families awex 0.9.0 registers converters for
    (`WEIGHT_SYNCS["awex"].architectures`, among engines/weight_sync/awex.py REGISTERED_ARCHITECTURES): a Llama
    actor with weight_sync.backend awex is refused at --check (the job would stop at the actor's start),
    naming the field, the value and the way out; the torch broadcast passes."""
    import json

    from mopd_hpc.config.capabilities import MODEL_FAMILIES, WEIGHT_SYNCS
    from mopd_hpc.engines.weight_sync.awex import REGISTERED_ARCHITECTURES

    assert set(WEIGHT_SYNCS["awex"].architectures) == REGISTERED_ARCHITECTURES & set(MODEL_FAMILIES)
    ckpt = tmp_path / "llama"
    shutil.copytree(moe_checkpoint, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(
        json.dumps(config | {"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    overrides = [f"models.actor.path={ckpt}", f"models.tokenizer.path={ckpt}",
                 f"models.teachers.0.path={moe_checkpoint}", "allow_unverified=true"]  # fmt: skip
    with pytest.raises(ConfigError) as err:
        prepare_models(load_run_config(CODER, [*overrides, "weight_sync.backend=awex"]), str(CODER))
    text = str(err.value)
    assert "1 problem" in text
    assert (
        f"weight_sync.backend: the actor ({ckpt}) is a LlamaForCausalLM: awex converts Qwen3ForCausalLM / "
        "Qwen3MoeForCausalLM checkpoints only (got 'awex'; weight_sync.backend: torch)" in text
    )
    prepare_models(load_run_config(CODER, [*overrides, "weight_sync.backend=torch"]), str(CODER))


def test_expert_parallel_not_dividing_the_checkpoints_experts_is_refused(moe_checkpoint: Path) -> None:
    """launch/moe_check.py: the micro MoE has 2 experts a layer; EP 4 (it divides the DP size 32) cannot split
    them, refused with the opt-in too; EP 2 passes that check (the opt-in lets the rest through)."""
    path = str(moe_checkpoint)
    overrides = [
        f"models.actor.path={path}", f"models.tokenizer.path={path}", f"models.teachers.0.path={path}",
        "models.actor.tensor_parallel=1", "allow_unverified=true",
    ]  # fmt: skip
    with pytest.raises(ConfigError) as err:
        prepare_models(load_run_config(CODER, [*overrides, "models.actor.expert_parallel=4"]), str(CODER))
    assert (
        f"models.actor.expert_parallel: the actor ({path}) is a Qwen3MoeForCausalLM of 2 experts a layer: 4 ranks "
        "cannot hold an equal share of them (got 4; a divisor of 2 (2, ...), or 1)" in str(err.value)
    )
    prepare_models(load_run_config(CODER, [*overrides, "models.actor.expert_parallel=2"]), str(CODER))
