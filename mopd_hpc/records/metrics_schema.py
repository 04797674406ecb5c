"""The metrics line contract: `run_dir/metrics.jsonl`, one JSON object per training step (issue 6 writes it).

Every line is an object with these keys (floats unless said; unknown extra keys are allowed and ignored by
readers that do not know them):

| key | meaning, unit |
|---|---|
| `step` (int, >= 0) | the training step this line reports (lines come in step order; a resumed run may repeat steps: the last line of a step wins) |
| `ts` | Unix time in seconds when the step ended |
| `loss/total`, `loss/mopd`, `loss/rl` | the loss terms L = c_rl·L_RL + c_d·L_MOPD (DESIGN.md §3) |
| `loss/sft` (optional) | an SFT warm-up step's cross-entropy on the teachers' greedy answers (`loss.sft_warmup_steps` / `sft_warmup_ratio`; then equal to `loss/total`; `loss/mopd` is 0 and the `mopd/*` values are null: no student sample, no μ) |
| `mopd/reverse_kl` | per-token reverse KL(π_θ ‖ Σ_j w_j π_j), averaged over response tokens (nats) |
| `mopd/rho_mean` | mean importance ratio ρ_t after truncation/masking |
| `mopd/ratio_capped_frac`, `mopd/ratio_masked_frac` | fraction of tokens whose ratio was capped / masked, in [0, 1] |
| `mopd/logprob_mismatch` | the train/inference mismatch: mean over response tokens of abs(log π_θ(y_t) − log μ(y_t)) with the policy before the step's update (nats; its effect with and without rollout routing replay, `rollout.routing_replay`) |
| `mopd/teacher_student_gap` | mean of S − W·log π_θ(y_t) over response tokens (nats) |
| `mopd/teacher_refused_tokens` (optional) | (row, position, teacher) entries of the step whose teacher log-prob was −inf (a refusal), taken as log(float32 tiny) ≈ −87.34 in S (mopd/targets.py); present when teachers score |
| `router/load_balancing_loss`, `router/z_loss` (optional) | a mixture-of-experts actor with a router loss (`loss.router_aux_loss_coefficient` or its model's default > 0, or `loss.router_z_loss_coefficient` > 0): the Switch Transformer load-balancing loss (E·Σ_i f_i·P_i, f_i the selections of expert i per position: k when balanced) and the ST-MoE z-loss (mean logsumexp² of the router logits) of the step's forward, token-weighted means over its micro-batches, before their coefficients (`engines/moe_routing.py`; the megatron actor: megatron-core's, the load-balancing loss the mean of its per-layer ones, `engines/megatron/router_losses.py`) |
| `reward/<route>`, `accuracy/<route>` | mean reward / accuracy of the step's rollouts of one route |
| `eval/pass@1/<route>`, `eval/mean@k/<route>` (optional) | held-out evaluation of the student on the rollout engines with the weights of this step, fractions in [0, 1]: greedy pass@1, and the mean accuracy of k = data.eval.samples sampled completions per prompt (present when k > 0); only on the lines of the evaluation steps (every data.eval.interval steps and the last, when the interval is set; `trainer/evaluator.py`) |
| `perf/tokens_per_s` | trained tokens per second of wall time |
| `time/rollout_s`, `time/teacher_s`, `time/drain_s`, `time/train_s`, `time/sync_s` | seconds per phase |
| `time/sync/<span>_s` (optional) | seconds of one sub-phase of the step's weight sync (part of `time/sync_s`; spans may nest): torch export, send; ipc export, fill, post, copy; awex publish, the writer's spans and `reader<i>_<span>` of each rollout engine (`engines/weight_sync/awex_spans.py`) |
| `time/train/prepare_s`, `time/train/forward_backward_s`, `time/train/optimizer_s` | seconds of the TRAIN phase's parts (each part of `time/train_s`, the rest of which is the engine's other work: the batch to the device, the step's token counts, `observe`, the statistics' reduction): the `before_train` callback (the actor's onload when it was offloaded; `trainer/rank_step.py`), every micro-batch's forward, loss and backward, and the gradients' finalize (megatron) / clipping and the optimizer step; device time (CUDA synchronized at each boundary, `engines/span_clock.py`); rank 0's values at data-parallel > 1 (not reduced over the ranks, as `time/train_s`) |
| `ref/kl`, `time/reference_s` | only with a KL penalty (loss.rl_coefficient > 0 and kl_coefficient > 0): the mean k3 KL(π_θ ‖ π_ref) over response tokens with the policy before the step's update (nats; 0 at step 1, where π_θ = π_ref), and rank 0's seconds of the reference model's scoring (part of `time/teacher_s`) |
| `memory/<child>/<phase>/allocated_gib`, `memory/<child>/<phase>/reserved_gib` | peak GPU memory of one child during one phase of the step, GiB (2^30 bytes): torch's `max_memory_allocated` / `max_memory_reserved` since the phase began (the peak is reset at each phase start); only for children on CUDA (absent on CPU). `<child>` is `actor` (the controller's rank), `teacher/<id>` or `rollout/<i>` (hf engines: each server's requests of that phase, `engines/memory/peaks.py`; sglang engines: `reserved_gib` only, the driver's (NVML) used memory of the engine's whole process tree, its scheduler subprocesses and CUDA contexts included, sampled around its memory release/resume and weight updates: `teacher`, `drain` and `train` hold what is left after the release, `engines/rollout/tree_memory.py`), `<phase>` a phase of the step (`rollout`, `teacher`, `drain`, `train`, `sync`), or for a server `held`: what it holds between its requests, read at the step's end |

Evaluation (`run_dir/eval.json`): `{"routes": {ROUTE: {"teacher": acc, "student_start": acc, "student_end": acc,
"n": prompts}}, "teachers": {ROUTE: {TEACHER_ID: acc}}, "student_weights": {"start": version, "end": version},
"k": k, "points": [{"step": s, "weight_version": version, "pass@1": {ROUTE: acc}, "mean@k": {ROUTE: acc}}]}`
(`trainer/evaluate.py`, `trainer/evaluator.py`: the student evaluated on the rollout engines; `version` their
weight_version; a point at the start, every data.eval.interval steps and at the end).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Required keys of every metrics line.
STEP_KEY = "step"
TS_KEY = "ts"
#: Loss and MOPD diagnostics the summary shows (in this order).
LOSS_KEYS = ("loss/total", "loss/mopd", "loss/rl")
MOPD_KEYS = (
    "mopd/reverse_kl",
    "mopd/rho_mean",
    "mopd/ratio_capped_frac",
    "mopd/ratio_masked_frac",
    "mopd/teacher_student_gap",
)
#: The router losses of a mixture-of-experts actor (present when one is computed).
ROUTER_KEYS = ("router/load_balancing_loss", "router/z_loss")
TOKENS_PER_S_KEY = "perf/tokens_per_s"
#: Per-route families: `<prefix><route>`.
REWARD_PREFIX = "reward/"
ACCURACY_PREFIX = "accuracy/"
#: Held-out evaluation points: `eval/<stat>/<route>`, stat one of EVAL_STATS.
EVAL_PREFIX = "eval/"
EVAL_STATS = ("pass@1", "mean@k")
#: Phase timings, in the phase machine's order (DESIGN.md §3): key → phase name.
PHASE_KEYS: Mapping[str, str] = {
    "time/rollout_s": "rollout",
    "time/teacher_s": "teacher",
    "time/drain_s": "drain",
    "time/train_s": "train",
    "time/sync_s": "sync",
}
#: Parts of the TRAIN phase (of `time/train_s`, seconds, rank 0's): `before_train`, then the engine's
#: micro-batches' forward + backward and its gradient finalize/clip + optimizer step (`train_step` returns the
#: last two under these names).
TRAIN_PREPARE_KEY = "time/train/prepare_s"
TRAIN_FORWARD_BACKWARD_KEY = "time/train/forward_backward_s"
TRAIN_OPTIMIZER_KEY = "time/train/optimizer_s"
TRAIN_SPAN_KEYS = (TRAIN_PREPARE_KEY, TRAIN_FORWARD_BACKWARD_KEY, TRAIN_OPTIMIZER_KEY)
#: Peak GPU memory per child and phase: `memory/<child>/<phase>/<kind>` with kind one of MEMORY_KINDS (GiB).
MEMORY_PREFIX = "memory/"
MEMORY_KINDS = ("allocated_gib", "reserved_gib")
#: Keys whose series the summary keeps (sparklines, --plot); per-route keys are added as they appear.
SERIES_KEYS = (*LOSS_KEYS, "mopd/reverse_kl", TOKENS_PER_S_KEY)


class MetricsLineError(ValueError):
    """A metrics line that breaks the contract (not an object, no int `step`, no numeric `ts`)."""


@dataclass(frozen=True, slots=True)
class MetricsLine:
    """One parsed metrics line.

    Attributes:
        step: the training step (int >= 0).
        ts: Unix seconds (float).
        values: every other numeric key → float (non-numeric extras dropped; NaN kept as NaN).
    """

    step: int
    ts: float
    values: Mapping[str, float]

    @classmethod
    def from_obj(cls, obj: Any) -> MetricsLine:
        """Validate one decoded JSON line.

        Raises:
            MetricsLineError: `obj` is not an object, or `step`/`ts` is missing or of the wrong type.
        """
        if not isinstance(obj, dict):
            raise MetricsLineError(f"metrics line is {type(obj).__name__}: expected a JSON object")
        step = obj.get(STEP_KEY)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise MetricsLineError(f"metrics line step={step!r}: expected an integer >= 0")
        ts = obj.get(TS_KEY)
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
            raise MetricsLineError(f"metrics line ts={ts!r} (step {step}): expected Unix seconds (a number)")
        values = {
            k: float(v)
            for k, v in obj.items()
            if k not in (STEP_KEY, TS_KEY) and isinstance(v, int | float) and not isinstance(v, bool)
        }
        return cls(step=step, ts=float(ts), values=values)


def route_of(key: str) -> tuple[str, str] | None:
    """`"reward/gsm8k"` → `("reward", "gsm8k")`; `"accuracy/x"` → `("accuracy", "x")`; else None."""
    for prefix in (REWARD_PREFIX, ACCURACY_PREFIX):
        if key.startswith(prefix) and len(key) > len(prefix):
            return prefix[:-1], key[len(prefix) :]
    return None


def eval_key(stat: str, route: str) -> str:
    """`eval/<stat>/<route>`; stat one of EVAL_STATS. Raises ValueError for another stat."""
    if stat not in EVAL_STATS:
        raise ValueError(f"evaluation statistic {stat!r}: expected one of {EVAL_STATS}")
    return f"{EVAL_PREFIX}{stat}/{route}"


def eval_of(key: str) -> tuple[str, str] | None:
    """`"eval/pass@1/gsm8k"` → `("pass@1", "gsm8k")`; None for any other key."""
    if not key.startswith(EVAL_PREFIX):
        return None
    stat, _, route = key[len(EVAL_PREFIX) :].partition("/")
    return (stat, route) if stat in EVAL_STATS and route else None


def memory_key(child: str, phase: str, kind: str) -> str:
    """`memory/<child>/<phase>/<kind>`; kind one of MEMORY_KINDS."""
    return f"{MEMORY_PREFIX}{child}/{phase}/{kind}"


def memory_of(key: str) -> tuple[str, str, str] | None:
    """`"memory/actor/train/reserved_gib"` → `("actor", "train", "reserved_gib")` (a child may hold `/`, e.g.
    `teacher/math`: the phase and kind are the last two parts); None for any other key."""
    if not key.startswith(MEMORY_PREFIX):
        return None
    parts = key[len(MEMORY_PREFIX) :].split("/")
    if len(parts) < 3 or parts[-1] not in MEMORY_KINDS or not all(parts):
        return None
    return "/".join(parts[:-2]), parts[-2], parts[-1]
