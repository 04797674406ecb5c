"""The one table of config fields that have no effect in some settings: field → condition → reason (issue 19).

Every other field changes something observable whenever it changes (the job plan, the sbatch script, the
`--dry-run` text, a `--check` warning or refusal, the data stream, the rollout request, a train step's
loss): tests/config/test_config_mutation.py mutates every field of the RunConfig type tree and checks that, and
checks each row here the other way (under its condition the mutation changes nothing observable). A field
path uses `[]` for a list item and `*` for any name (`cluster.*.gpu_memory_gb`: the field of every group).

    from mopd_hpc.config.inert_fields import INERT, inert_fields, inert_warnings
    inert_fields(cfg)    # [(row, reason)] of the rows whose condition holds for this config
    inert_warnings(cfg)  # a Problem per field set (≠ its default) where its row holds: --check warns
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from mopd_hpc.config.parallel import actor_world
from mopd_hpc.config.problems import Problem

#: Why the per-token ratio's knobs have no effect with the top-k estimator (config/loss.py, mopd/objective.py).
TOPK_NO_RATIO = (
    "with topk the correction is 'none' (config/loss.py refuses 'truncate' and 'mask' there: the per-position "
    "reverse KL does not depend on the sampled token), so no ratio is capped or masked"
)


@dataclass(frozen=True, slots=True)
class InertField:
    """One row: `field` (a path pattern) has no effect on a config for which `when(cfg)` is true.

    Attributes:
        field: YAML path pattern of the field (`loss.ratio_cap`, `models.teachers[].path`, `cluster.*.qos`).
        condition: `when` in words, in field terms (`loss.estimator is 'topk'`).
        when: the condition on a validated RunConfig.
        reason: why the field has no effect then (which consumer skips it).
    """

    field: str
    condition: str
    when: Callable[[Any], bool]
    reason: str

    def matches(self, path: str) -> bool:
        """Whether the field path `path` (as the type-tree walk writes it) is this row's field."""
        return fnmatch.fnmatchcase(path, self.field.replace("[]", "[[][]]"))


def _topk(cfg: Any) -> bool:
    return cfg.loss.estimator == "topk"


def _no_distillation(cfg: Any) -> bool:
    return cfg.loss.distillation_coefficient == 0


_NO_TEACHER = "no teacher is loaded or scored (plan/placement.py starts none; mopd/plan.py ExecutionPlan)"

INERT: tuple[InertField, ...] = (
    InertField("models.actor.id", "always", lambda c: True, "a label in mopd-submit's summary line only"),
    InertField(
        "models.actor.collective_timeout_s",
        "the actor's world is 1 rank",
        lambda c: actor_world(c.cluster, c.rollout).size == 1,
        "one rank has no collective to wait in (roles/actor_group.py join_group: SoloGroup)",
    ),
    InertField(
        "weight_sync.awex_mode",
        "always",
        lambda c: True,
        "only the mode rollout.mode implies is valid (config/weight_sync_rules.py awex_backend), and null resolves to it",
    ),
    *(
        InertField(
            f"models.teachers[].{name}", "loss.distillation_coefficient is 0", _no_distillation, _NO_TEACHER
        )
        for name in ("id", "path", "engine", "dtype", "replicas", "request_timeout_s", "residency")
    ),
    InertField(
        "models.teachers[].residency",
        "the teachers' group has no GPUs",
        lambda c: c.cluster.teacher_group.gpus_per_node == 0,
        "no effect on a group without GPUs: nothing moves between phases on CPU (roles/residency.py "
        "teachers_to_offload)",
    ),
    InertField(
        "rollout.compile_decode",
        "the rollout group has no GPUs",
        lambda c: c.cluster.rollout_group.gpus_per_node == 0,
        "the CPU loop decoder is never compiled (engines/rollout/hf_engine.py HFRolloutEngine compile_decode)",
    ),
    InertField("routes", "loss.distillation_coefficient is 0", _no_distillation, _NO_TEACHER),
    *(
        InertField(
            f"loss.{name}",
            "loss.distillation_coefficient is 0",
            _no_distillation,
            "L_MOPD is off: only L_RL is computed (mopd/compose.py), and its terms read none of these",
        )
        for name in (
            "estimator",
            "topk",
            "correction",
            "ratio_cap",
            "mask_low",
            "mask_high",
            "advantage_clip",
            "orm_alpha",
        )
    ),
    InertField(
        "cluster.max_requeues",
        "cluster.requeue is false",
        lambda c: not c.cluster.requeue,
        "the batch shell never requeues (sbatch_templates/_control.sh.j2 mopd_requeue_allowed)",
    ),
    InertField(
        "loss.topk",
        "loss.estimator is 'sampled'",
        lambda c: c.loss.estimator == "sampled",
        "the sampled estimator asks the teachers for token log-probs, no top-k (trainer/rank_step.py)",
    ),
    *(
        InertField(f"loss.{name}", "loss.estimator is 'topk'", _topk, TOPK_NO_RATIO)
        for name in ("ratio_cap", "mask_low", "mask_high")
    ),
    InertField(
        "loss.advantage_clip",
        "loss.estimator is 'topk'",
        _topk,
        "the top-k estimator's reverse KL has no per-token advantage to clip (mopd/topk.py topk_reverse_kl)",
    ),
    InertField(
        "loss.ratio_cap",
        "loss.correction is not 'truncate'",
        lambda c: c.loss.correction != "truncate",
        "only the 'truncate' correction caps the ratio (mopd/loss.py)",
    ),
    *(
        InertField(
            f"loss.{name}",
            "loss.correction is not 'mask'",
            lambda c: c.loss.correction != "mask",
            "only the 'mask' correction has a kept band (mopd/loss.py)",
        )
        for name in ("mask_low", "mask_high")
    ),
    InertField(
        "loss.ppo_clip",
        "loss.rl_coefficient is 0",
        lambda c: c.loss.rl_coefficient == 0,
        "the clipped surrogate is L_RL's, which is off (mopd/compose.py)",
    ),
    InertField(
        "data.eval.seed",
        "data.eval.size is 0 and no source has an eval_fraction",
        lambda c: (
            c.data.eval.size == 0
            and not any(getattr(s, "eval_fraction", None) is not None for s in c.data.sources)
        ),
        "no held-out split is drawn (trainer/data_setup.py eval_prompts; a jsonl source's eval_fraction "
        "draws its held-out rows by it, data/holdout.py)",
    ),
    *(
        InertField(
            f"data.eval.{name}",
            "data.eval.size is 0",
            lambda c: c.data.eval.size == 0,
            "nothing is evaluated (trainer/intervals.py eval_due, trainer/evaluator.py)",
        )
        for name in ("interval", "samples")
    ),
    InertField(
        "export.keep",
        "export.interval is 0",
        lambda c: c.export.interval == 0,
        "no periodic export is written (trainer/intervals.py export_due)",
    ),
    *(
        InertField(
            f"cluster.*.{name}",
            "the group's gpus_per_node is 0",
            lambda c: any(g.gpus_per_node == 0 for g in c.cluster.groups().values()),
            "a group without GPUs has no GPU memory plan to check (plan/memory_plan.py)",
        )
        for name in ("gpu_memory_gb", "gpu_type")
    ),
)


def inert_fields(cfg: Any) -> list[tuple[InertField, str]]:
    """The rows whose condition holds for the validated RunConfig `cfg`, each with its reason."""
    return [(row, row.reason) for row in INERT if row.when(cfg)]


def _leaves(node: Any, path: str = "") -> Iterator[tuple[str, Any, Any, BaseModel, str]]:
    """(concrete path, value, declared default or NO_DEFAULT, parent section, name) of every field below
    `node` (a model or a list of them)."""
    items = node if isinstance(node, list) else []
    for i, item in enumerate(items):
        yield from _leaves(item, f"{path}[{i}]")
    if not isinstance(node, BaseModel):
        return
    for name, info in type(node).model_fields.items():
        here = f"{path}.{name}" if path else name
        value = getattr(node, name)
        if isinstance(value, BaseModel | list):
            yield from _leaves(value, here)
        else:
            default = NO_DEFAULT if info.is_required() else info.get_default(call_default_factory=True)
            yield (here, value, default, node, name)


#: A field without a default (required): whatever its value, nobody set it "instead of" a default.
NO_DEFAULT: object = object()


def resolved_default(section: BaseModel, name: str) -> Any:
    """What field `name` of `section` is when left unset, the section's other fields as they are: a field
    whose declared default is resolved from its neighbours (`loss.correction`: 'none' with estimator topk,
    'truncate' with sampled) has that resolved value. The declared default when the section without the
    field does not validate."""
    try:
        return getattr(type(section).model_validate(section.model_dump(exclude={name})), name)
    except ValueError:  # pydantic's ValidationError: the declared default is what remains
        info = type(section).model_fields[name]
        return info.get_default(call_default_factory=True)


def inert_warnings(cfg: Any) -> list[Problem]:
    """One problem per field that is set to another value than its default where its row's condition holds
    (the setting has no effect: the user learns it at --check); rows whose condition is 'always', and
    required fields, are not warned (their value is a label, or implied by another field). The default is
    the resolved one (`resolved_default`): `loss.correction: none` with estimator topk is no setting."""
    live = [row for row in INERT if row.condition != "always" and row.when(cfg)]
    out = []
    for concrete, value, default, section, name in _leaves(cfg):
        if default is NO_DEFAULT or value == default:
            continue
        pattern = re.sub(r"\[\d+\]", "[]", concrete)
        for row in live:
            if row.matches(pattern) and _holds_for_its_group(row, cfg, concrete):
                if value == resolved_default(section, name):
                    break
                out.append(
                    Problem(
                        concrete,
                        f"has no effect when {row.condition}: {row.reason}",
                        value,
                        f"remove it; it takes effect once {row.condition} no longer holds",
                    )
                )
                break
    return out


def _holds_for_its_group(row: InertField, cfg: Any, concrete: str) -> bool:
    """A `cluster.*.<field>` row (a field of every het group: gpu_memory_gb) holds for a group without GPUs
    only, whatever the other groups have."""
    if not row.field.startswith("cluster.*."):
        return True
    group = getattr(cfg.cluster, concrete.split(".")[1], None)
    return group is None or group.gpus_per_node == 0
