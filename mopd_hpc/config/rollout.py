"""The `rollout:` and `weight_sync:` sections: how the behavior policy μ samples, and how it gets θ."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool, model_validator

from mopd_hpc.config.base import Section
from mopd_hpc.config.problems import Problem, raise_if_any

#: SGLang's share of an engine GPU for weights + KV pool when `rollout.mem_fraction_static` is null (what the
#: H100 runs of gpu_step_roles.json used; `SGLangLaunch.mem_fraction_static`'s default).
SGLANG_MEM_FRACTION = 0.5


class SamplingConfig(Section):
    """Sampling parameters of every rollout (the SGLang `sampling_params` subset the trainer sends)."""

    temperature: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="Softmax temperature (> 0: greedy decoding leaves no behavior distribution μ).",
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (0, 1]; 1 = off.")
    max_new_tokens: int = Field(ge=1, description="Longest response, in tokens.")


class RolloutEnginesConfig(Section):
    """Rollout server processes."""

    count: int = Field(1, ge=1, description="Number of rollout engines (servers).")
    tensor_parallel: int = Field(
        1, ge=1, description="GPUs per engine (tensor-parallel size, within a node)."
    )


class RolloutConfig(Section):
    """Rollout: who samples the responses (DESIGN.md §5), where, and with what settings."""

    backend: Literal["hf", "sglang"] = Field(
        "hf", description="'hf' (transformers generate, CPU/GPU) or 'sglang' (an sglang.Engine, GPU only)."
    )
    sampling: SamplingConfig = Field(description="Sampling parameters.")
    engines: RolloutEnginesConfig = Field(default_factory=RolloutEnginesConfig, description="Engine layout.")
    mode: Literal["separated", "colocated"] = Field(
        "separated",
        description="'separated': rollout engines on their own GPUs; 'colocated': on the actor's GPUs, "
        "time-sliced by the phase machine (offload/onload between phases).",
    )
    compile_decode: StrictBool = Field(
        True,
        description="hf backend on CUDA: the decode step compiled into CUDA graphs (torch.compile, "
        "reduce-overhead; about 40 s of compilation in the first step, then ~15x eager decoding), its static "
        "KV cache and the engine's weights held on the GPU in every phase (the graphs hold their addresses; "
        "the memory plan counts them). false: eager decoding, the KV cache held in the rollout phase only. "
        "The CPU loop decoder is never compiled; with backend sglang (its own CUDA graphs) only true.",
    )
    graph_rows: int | None = Field(
        None,
        ge=1,
        description="hf backend: rows one engine decodes together at most — its static KV cache (graph_rows × "
        "graph_length slots) and, on CUDA, its compiled decode step hold that many rows; a step's share of an "
        "engine is decoded in ⌈share / graph_rows⌉ batches (each row keeps its own sampling seed). null = "
        "the engine's whole share, ⌈batch_size / engines.count⌉ × samples_per_prompt. --check names the largest "
        "that fits the GPU when the memory plan does not.",
    )
    routing_replay: StrictBool = Field(
        False,
        description="Rollout routing replay (R3) for a mixture-of-experts actor: the rollout engines record the "
        "experts each response token was routed to in every MoE layer, and the actor's forward routes each "
        "token to them (the gate weights from its current router, differentiable), so that π_θ and μ use "
        "the same experts. hf backend (its loop decoder, eager: compile_decode false on a GPU rollout group) "
        "and torch or megatron actor only; a dense actor is refused at --check.",
    )
    mem_fraction_static: float | None = Field(
        None,
        gt=0,
        lt=1,
        allow_inf_nan=False,
        description="sglang backend: the fraction of each engine GPU's memory that SGLang takes for the "
        "model's weights and its KV pool (SGLang's `mem_fraction_static`; verl calls it "
        "gpu_memory_utilization), in (0, 1). Colocated, it is released when the step leaves ROLLOUT and resumed "
        "for the weight sync and the next rollout; the memory plan counts it in those phases. null = 0.5. "
        "Refused with backend hf (its KV cache is sized from the step's rows: graph_rows).",
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        le=86400,
        allow_inf_nan=False,
        description="Seconds the actor waits for one answer of a rollout engine (a step's /generate, a weight "
        "update, a pause or release), connecting and reading the answer included; past it the step fails "
        "with an error naming the engine's index and URL, and the job ends (a stopped or hung server). Raise "
        "it for long responses on slow hardware; at most 86400 (a day).",
    )
    forked: StrictBool = Field(
        True,
        description="Rollout engines run as children forked by the node's guard, so that a rollout crash or "
        "offload never takes the actor down. Must be true: the job starts every engine that way (one rollout "
        "child per engine, plan/placement.py); false is refused.",
    )

    @property
    def sglang_mem_fraction(self) -> float:
        """`mem_fraction_static`, or `SGLANG_MEM_FRACTION` when null (the sglang engine's static share)."""
        return SGLANG_MEM_FRACTION if self.mem_fraction_static is None else self.mem_fraction_static

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        raise_if_any(
            unforked_rollout(self) + uncompiled_sglang(self) + sglang_graph_rows(self) + hf_mem_fraction(self)
        )
        return self


def sglang_graph_rows(rollout: RolloutConfig) -> list[Problem]:
    """`graph_rows` with backend sglang is refused: it bounds the hf engine's static KV cache, and sglang sizes
    its own KV pool (accepting it would ignore it). Paths relative to `rollout`."""
    if rollout.graph_rows is None or rollout.backend != "sglang":
        return []
    why = "it bounds the hf engine's static KV cache; sglang sizes a KV pool of its own"
    return [
        Problem("graph_rows", why, rollout.graph_rows, "leave rollout.graph_rows out with backend sglang")
    ]


def hf_mem_fraction(rollout: RolloutConfig) -> list[Problem]:
    """`mem_fraction_static` with backend hf is refused: it sizes SGLang's static pool, and the hf engine sizes
    its KV cache from the step's rows (accepting it would ignore it). Paths relative to `rollout`."""
    if rollout.mem_fraction_static is None or rollout.backend == "sglang":
        return []
    why = "it is SGLang's static share of the GPU; the hf engine sizes its KV cache from the rows it decodes"
    way = "leave rollout.mem_fraction_static out with backend hf (rollout.graph_rows bounds its KV cache)"
    return [Problem("mem_fraction_static", why, rollout.mem_fraction_static, way)]


def uncompiled_sglang(rollout: RolloutConfig) -> list[Problem]:
    """`compile_decode: false` with backend sglang is refused: it is the hf engine's switch, and sglang
    captures its own CUDA graphs (accepting it would ignore it). Paths relative to `rollout`."""
    if rollout.compile_decode or rollout.backend != "sglang":
        return []
    why = "it switches the hf engine's compiled decode step; sglang captures CUDA graphs of its own"
    return [
        Problem("compile_decode", why, False, "leave rollout.compile_decode out (true) with backend sglang")
    ]


def unforked_rollout(rollout: RolloutConfig) -> list[Problem]:
    """`forked: false` is refused: the job has no other way to start a rollout engine than as a child of the
    node's guard (plan/placement.py gives every engine its own rollout child), so accepting false would
    run the forked engines anyway, the setting silently ignored (issue 19). Paths relative to `rollout`."""
    if rollout.forked:
        return []
    why = (
        "a colocated rollout must run as a forked child of the guard"
        if rollout.mode == "colocated"
        else "the job runs every rollout engine as a forked child of the node's guard; there is no unforked "
        "rollout (in the actor's process, or a server started elsewhere)"
    )
    return [Problem("forked", why, rollout.forked, "set rollout.forked: true (or leave it out: the default)")]


#: rollout.mode → the AWEX transfer mode it implies (weight_sync.awex_mode null follows it).
AWEX_MODES = {"colocated": "colocate", "separated": "separate"}


class WeightSyncConfig(Section):
    """Weight sync actor → rollout after each train step."""

    backend: Literal["torch", "ipc", "awex"] = Field(
        "torch",
        description="'torch': torch.distributed broadcast (gloo on CPU, NCCL on GPU; on GPU separated only: "
        "NCCL refuses two ranks on one GPU); 'ipc': shared buffers on one node (rollout.mode colocated, HF or "
        "sglang rollout engine; CUDA IPC on GPU, a /dev/shm file on CPU); 'awex': AWEX writer/reader (megatron "
        "actor; HF rollout engine at TP 1, or sglang).",
    )
    awex_mode: Literal["colocate", "separate"] | None = Field(
        None,
        description="AWEX transfer mode; null = follow rollout.mode (colocated → colocate, "
        "separated → separate). Only for backend 'awex'.",
    )

    @model_validator(mode="after")
    def _check(self) -> WeightSyncConfig:
        if self.backend != "awex" and self.awex_mode is not None:
            raise_if_any(
                [
                    Problem(
                        "awex_mode",
                        f"applies only to backend 'awex' (backend is {self.backend!r})",
                        self.awex_mode,
                        "remove it, or set weight_sync.backend: awex",
                    )
                ]
            )
        return self
