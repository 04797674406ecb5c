"""`RunConfig`: the whole run.yaml, validated before any process starts.

    cfg = RunConfig.from_yaml("configs/local_cpu.yaml")      # or from_dict / from_yaml_text
    text = cfg.to_yaml()                                      # from_yaml_text(text) == cfg

Loading raises one `ConfigError` that lists every problem (`<yaml.path>: <what> (got <value>; <expected>)`):
field errors of every section, the rules inside each valid section, and the cross-section rules of
`rules.py` whose sections are valid.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError, model_validator

from mopd_hpc.config import rules
from mopd_hpc.config.base import Section
from mopd_hpc.config.cluster import ClusterConfig
from mopd_hpc.config.convert import problems_from_validation_error
from mopd_hpc.config.data import TASK_CHECK, DataConfig
from mopd_hpc.config.export import ExportConfig
from mopd_hpc.config.loss import LossConfig
from mopd_hpc.config.models import ModelsConfig
from mopd_hpc.config.problems import ConfigError, Problem, RuleViolation
from mopd_hpc.config.rollout import RolloutConfig, WeightSyncConfig
from mopd_hpc.config.types import Identifier, NonEmptyStr
from mopd_hpc.config.yaml_io import dump_yaml, load_yaml_text
from mopd_hpc.config.yaml_limits import MAX_BYTES

#: Teacher weight of a route (w_j ≥ 0, finite; DESIGN.md §3).
TeacherWeight = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class RunConfig(Section):
    """One MOPD run: models, routes, data, loss, rollout, weight sync, cluster, and the run's clock."""

    name: Identifier = Field(description="Run name: Slurm job name and metrics label.")
    run_dir: NonEmptyStr = Field(
        description="Run directory (logs, metrics, checkpoints, job secret); re-running on it resumes."
    )
    seed: int = Field(0, ge=0, description="Seed of data order, sampling and initialization.")
    steps: int = Field(ge=1, description="Training steps (one batch of data.batch_size prompts each).")
    checkpoint_interval: int = Field(ge=1, description="Checkpoint every this many steps.")
    log_interval: int = Field(
        1, ge=1, description="Write a metrics line every this many steps (and at the last step)."
    )
    export: ExportConfig = Field(
        default_factory=ExportConfig, description="Periodic Hugging Face exports of the student."
    )
    models: ModelsConfig = Field(description="Actor, teachers, tokenizer.")
    routes: dict[Identifier, dict[Identifier, TeacherWeight]] = Field(
        min_length=1,
        description="route → {teacher_id: weight}: the target of a prompt of that route is "
        "S = Σ_j w_j·log π_j (weights ≥ 0, not all 0; one teacher per route is the usual case).",
    )
    data: DataConfig = Field(description="Prompt sources and batch shape.")
    loss: LossConfig = Field(
        default_factory=LossConfig, description="MOPD loss (default: pure distillation)."
    )
    rollout: RolloutConfig = Field(description="Rollout engines and sampling.")
    weight_sync: WeightSyncConfig = Field(
        default_factory=WeightSyncConfig, description="Weight sync actor → rollout."
    )
    cluster: ClusterConfig = Field(description="Backend, job shape, resources.")
    allow_unverified: bool = Field(
        False,
        description="Run settings whose code is written but has not run on GPUs here (megatron at "
        "tensor_parallel, data-parallel or expert-parallel size > 1, a megatron teacher at tensor_parallel > 1, "
        "AWEX from several trainer ranks, AWEX moving a Qwen3-MoE actor's experts to a separated rollout: "
        "config/capabilities.py `unverified`, `untested`, `experts_untested`): each becomes a warning (--check, the run dir's "
        "unverified.json, mopd-logs summarize) instead of a refusal; what is unsupported stays refused. "
        "`mopd-submit --allow-unverified` sets it.",
    )

    @model_validator(mode="before")
    @classmethod
    def _resolve_awex_mode(cls, data: Any) -> Any:
        """Resolve weight_sync.awex_mode from rollout.mode when it is null (the resolved config shows it)."""
        if not isinstance(data, dict):
            return data
        sync, rollout = data.get("weight_sync"), data.get("rollout")
        if isinstance(sync, dict) and sync.get("backend") == "awex" and sync.get("awex_mode") is None:
            mode = rollout.get("mode", "separated") if isinstance(rollout, dict) else None
            if mode in ("colocated", "separated"):
                data = {**data, "weight_sync": {**sync, "awex_mode": mode.removesuffix("d")}}
        return data

    @model_validator(mode="after")
    def _cross_section(self) -> RunConfig:
        problems = rules.check({name: getattr(self, name) for name in type(self).model_fields})
        if problems:
            raise RuleViolation(problems)
        return self

    # ----------------------------------------------------------------------------------- loading

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>", *, check_tasks: bool = True) -> RunConfig:
        """Validate a plain mapping (as YAML loads it). `check_tasks` False: reasoning-gym task names and
        `task_args` are not checked against reasoning-gym's registry (config/data.py: for a process that
        generates no data, reading a config `mopd-submit` checked; it saves importing reasoning-gym).

        Raises:
            ConfigError: listing every problem found.
        """
        if not isinstance(data, Mapping):
            what = "an empty document" if data is None else type(data).__name__
            raise ConfigError(
                [Problem("", "a run config is a mapping of sections", what, "models:, routes:, ...")], source
            )
        data = dict(data)
        context = {TASK_CHECK: check_tasks}
        try:
            return cls.model_validate(data, context=context)
        except ValidationError as exc:
            problems = problems_from_validation_error(cls, data, exc)
            failed = {str(e["loc"][0]) for e in exc.errors() if e["loc"]}
            if failed:  # the cross-section rules did not run: run those whose sections are valid
                problems.extend(rules.check(_valid_sections(cls, data, failed, context)))
            raise ConfigError(_dedupe(problems), source) from None

    @classmethod
    def from_yaml_text(cls, text: str, source: str = "<string>", *, check_tasks: bool = True) -> RunConfig:
        """Parse and validate YAML text (`check_tasks`: as `from_dict`). Raises ConfigError (syntax errors and
        duplicate keys included)."""
        document, problems = load_yaml_text(text)
        if problems and document is None:
            raise ConfigError(problems, source)
        try:
            cfg = cls.from_dict(document, source, check_tasks=check_tasks)
        except ConfigError as exc:
            raise ConfigError([*problems, *exc.problems], source) from None
        if problems:
            raise ConfigError(problems, source)
        return cfg

    @classmethod
    def from_yaml(cls, source: str | os.PathLike[str], *, check_tasks: bool = True) -> RunConfig:
        """Read and validate a YAML file, or YAML text: a `str` with a newline in it is text, so that
        `RunConfig.from_yaml(cfg.to_yaml()) == cfg` (`check_tasks`: as `from_dict`). Raises ConfigError (an
        unreadable file included)."""
        if isinstance(source, str) and "\n" in source:
            return cls.from_yaml_text(source, check_tasks=check_tasks)
        return cls.from_yaml_text(read_config_text(source), source=str(source), check_tasks=check_tasks)

    def to_yaml(self) -> str:
        """The resolved config as YAML (every field, defaults included); from_yaml_text() gives it back."""
        return dump_yaml(self.model_dump(mode="json"))

    # ---------------------------------------------------------------------------------- queries

    def route_weights(self, route: str) -> dict[str, float]:
        """{teacher_id: w_j} of a route; KeyError names the known routes."""
        if route not in self.routes:
            raise KeyError(f"unknown route {route!r} (known: {', '.join(self.routes)})")
        return dict(self.routes[route])

    def used_route_weights(self) -> dict[str, dict[str, float]]:
        """route → {teacher_id: w_j} for every route the data uses (`data.routes_used`, in its order): the
        weights the train step and the evaluation read."""
        return {route: self.route_weights(route) for route in self.data.routes_used}

    def warnings(self) -> list[str]:
        """Legal but suspicious settings (a teacher no route weights, ...), rendered one per line."""
        return rules.config_warnings(self)


def read_config_text(path: str | os.PathLike[str]) -> str:
    """The text of a config file. Raises ConfigError naming the path when it cannot be read or is over
    yaml_limits.MAX_BYTES (read no further than the limit: a config path at /dev/zero ends too)."""
    try:
        with Path(path).open("rb") as f:
            raw = f.read(MAX_BYTES + 1)
        if len(raw) > MAX_BYTES:
            raise ConfigError(
                [
                    Problem(
                        "", f"config file too large: over {MAX_BYTES} bytes (the limit is {MAX_BYTES} bytes)"
                    )
                ],
                str(path),
            )
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(
            [Problem("", f"cannot read the config file: {reason}", str(path))], str(path)
        ) from None


def _valid_sections(
    cls: type[RunConfig], data: dict[str, Any], failed: set[str], context: dict[str, Any]
) -> dict[str, Any]:
    """Top-level values that validate on their own (for running cross-section rules on a broken config)."""
    values: dict[str, Any] = {}
    for name, field in cls.model_fields.items():
        if name in failed or (name not in data and field.is_required()):
            continue
        try:
            if name in data:
                values[name] = TypeAdapter(Annotated[field.annotation, field]).validate_python(
                    data[name], context=context
                )
            else:
                values[name] = field.get_default(call_default_factory=True, validated_data=values)
        except (ValidationError, TypeError, ValueError):
            continue
    return values


def _dedupe(problems: list[Problem]) -> list[Problem]:
    seen: set[str] = set()
    out = []
    for p in problems:
        if p.render() not in seen:
            seen.add(p.render())
            out.append(p)
    return out
