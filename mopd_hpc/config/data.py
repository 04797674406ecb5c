"""The `data:` section: prompt sources (each with its route), the mixture policy, batch shape, eval split.

reasoning-gym task names and `task_args` are checked against reasoning-gym's own registry and config
classes when the config is built (an unknown task or argument is a config error, not a crash at step 0), unless
the validation context says `TASK_CHECK: False` (`RunConfig.from_dict(..., check_tasks=False)`): a process that
generates no data (a teacher or rollout server reading the config `mopd-submit` checked) then does not import
reasoning-gym, which costs ≈ 1.3 CPU-s (it imports sympy and matplotlib).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, model_validator

from mopd_hpc.config.base import Section
from mopd_hpc.config.problems import Problem, join_path, known, raise_if_any
from mopd_hpc.config.rewards import BUILTIN_REWARDS, ImportPathError, load_object
from mopd_hpc.config.types import Identifier, NonEmptyStr

#: reasoning-gym arguments set by mopd_hpc itself (seed from the run seed / data.eval.seed, size from
#: steps), so a source must not set them.
RESERVED_TASK_ARGS = ("seed", "size")
#: Default seed of the held-out split: far from training seeds, because reasoning-gym seeds item i
#: with Random(seed + i) (see shared/reference/tiny_calibration.md, held-out set).
DEFAULT_EVAL_SEED = 10_000_000
#: Key of the pydantic validation context: False skips the reasoning-gym registry check (module docstring).
TASK_CHECK = "check_reasoning_gym_tasks"


def reasoning_gym_problems(task: str, task_args: dict[str, Any]) -> list[Problem]:
    """Check a reasoning-gym task name and its arguments against reasoning-gym's registry.

    Paths are relative to the source (`task`, `task_args.<arg>`). Imports reasoning_gym (≈ 0.8 s) lazily.
    """
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        import difflib

        close = difflib.get_close_matches(task, DATASETS, n=3)
        hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else f"{len(DATASETS)} tasks"
        return [Problem("task", "unknown reasoning-gym task", task, hint)]
    config_cls = DATASETS[task][1]
    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in RESERVED_TASK_ARGS]
    problems = []
    for arg in task_args:
        if arg in RESERVED_TASK_ARGS:
            problems.append(
                Problem(
                    join_path("task_args", arg),
                    "set by mopd_hpc (the run seed / data.eval.seed; size from steps)",
                    task_args[arg],
                    "remove it",
                )
            )
        elif arg not in fields:
            problems.append(
                Problem(join_path("task_args", arg), f"unknown argument of task {task!r}", arg, known(fields))
            )
    if problems:
        return problems
    try:
        config = config_cls(**task_args)
        if hasattr(config, "validate"):
            config.validate()
    except (AssertionError, TypeError, ValueError) as exc:
        return [Problem("task_args", f"rejected by reasoning-gym's {config_cls.__name__}: {exc}", task_args)]
    return []


def scoring_problems(source: Any) -> list[Problem]:
    """Problems of a source's template and reward fields (paths relative to the source).

    A chat field on a raw source is refused (nothing in a config is ignored); the reward must be a built-in
    the kind takes, or a `module:function` that imports here (so `--check` names a bad path); `regex` needs a
    `reward_pattern` that compiles, and no other reward takes one.
    """
    problems = []
    if source.template == "raw":
        for name in ("system_prompt", "chat_template_kwargs"):
            if getattr(source, name):
                problems.append(
                    Problem(
                        name,
                        "applies to template 'chat' only",
                        getattr(source, name),
                        "set template: chat, or remove it",
                    )
                )
    reward = source.reward
    way = f"one of {', '.join(BUILTIN_REWARDS)}, or an importable 'module:function'"
    if reward is None or reward in BUILTIN_REWARDS:
        if reward == "reasoning_gym" and source.kind != "reasoning_gym":
            problems.append(Problem("reward", "scores reasoning-gym sources only", reward, way))
    else:
        try:
            load_object(reward)
        except ImportPathError as exc:
            problems.append(Problem("reward", str(exc), reward, way))
    pattern = source.reward_pattern
    if reward == "regex" and not pattern:
        problems.append(
            Problem("reward_pattern", "reward 'regex' needs a pattern", pattern, "a Python regex")
        )
    elif reward != "regex" and pattern is not None:
        problems.append(Problem("reward_pattern", "applies to reward 'regex' only", pattern, "remove it"))
    elif pattern is not None:
        try:
            re.compile(pattern)
        except re.error as exc:
            problems.append(Problem("reward_pattern", f"not a valid regex: {exc}", pattern, "a Python regex"))
    return problems


class _SourceBase(Section):
    kind: str = Field(description="Source kind ('reasoning_gym' or 'jsonl').")
    name: Identifier = Field(description="Source name; unique; names its metrics.")
    route: Identifier = Field(description="Route (a key of `routes:`) of every prompt of this source.")
    weight: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Sampling weight for mixture 'weighted' (relative, normalized over sources); "
        "must be absent for the other mixtures.",
    )
    template: Literal["raw", "chat"] = Field(
        "raw",
        description="How a prompt is encoded: 'raw' (its text, with the tokenizer's special tokens) or 'chat' "
        "(the text as the user turn, through the tokenizer's chat template with the generation prompt; "
        "student and teachers get the same ids).",
    )
    system_prompt: str | None = Field(
        None, description="The chat's system turn (template 'chat' only); null = none."
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Variables passed to the chat template (template 'chat' only), e.g. "
        "{enable_thinking: false} for Qwen3.",
    )
    reward: str | None = Field(
        None,
        description="What scores a completion: 'reasoning_gym' (the dataset's score_answer; reasoning-gym "
        "sources only), 'exact', 'regex' (with reward_pattern), 'math' (math-verify on the final answer: "
        "\\boxed{}, '#### N'), or a user's 'module:function' called as function(completion, answer, entry) "
        "-> float in [0, 1], imported at --check; null = the kind's default (reasoning_gym / exact).",
    )
    reward_pattern: str | None = Field(
        None,
        description="Regex of reward 'regex': its last match in the completion (first group, if any), "
        "stripped, must equal the answer.",
    )

    @model_validator(mode="after")
    def _check_scoring(self) -> _SourceBase:
        raise_if_any(scoring_problems(self))
        return self


class ReasoningGymSource(_SourceBase):
    """Procedurally generated prompts from reasoning-gym; reward = the dataset's own `score_answer`."""

    kind: Literal["reasoning_gym"] = Field(description="Source kind.")
    task: NonEmptyStr = Field(description="reasoning-gym dataset name, e.g. 'chain_sum'.")
    task_args: dict[str, Any] = Field(
        default_factory=dict, description="Arguments of the task's reasoning-gym config class."
    )

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> ReasoningGymSource:
        if (info.context or {}).get(TASK_CHECK, True):
            raise_if_any(reasoning_gym_problems(self.task, self.task_args))
        return self


class JsonlSource(_SourceBase):
    """The user's own prompts: one JSON object per line, `{"prompt": ..., "answer": ...}`."""

    kind: Literal["jsonl"] = Field(description="Source kind.")
    path: NonEmptyStr = Field(description="Path of the .jsonl file (read at job start, on the job's nodes).")
    eval_fraction: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Held-out share of the file's rows, in (0, 1): ⌈fraction·rows⌉ rows drawn by data.eval.seed "
        "are kept out of training and evaluated (trainer/data_setup.py); exclusive with `eval_path`.",
    )
    eval_path: NonEmptyStr | None = Field(
        None,
        description="A separate .jsonl file of held-out prompts (the same format) evaluated under this source's "
        "route and reward; exclusive with `eval_fraction`.",
    )

    @model_validator(mode="after")
    def _check_split(self) -> JsonlSource:
        if self.eval_fraction is not None and self.eval_path is not None:
            raise_if_any(
                [
                    Problem(
                        "eval_path",
                        "a jsonl source takes one held-out split: eval_fraction or eval_path",
                        self.eval_path,
                        f"remove eval_path or eval_fraction ({self.eval_fraction})",
                    )
                ]
            )
        return self

    @property
    def held_out(self) -> bool:
        """Whether the source has a held-out split (`eval_fraction` or `eval_path`)."""
        return self.eval_fraction is not None or self.eval_path is not None


SourceConfig = Annotated[ReasoningGymSource | JsonlSource, Field(discriminator="kind")]


class EvalConfig(Section):
    """Held-out evaluation (per-route greedy pass@1 and sampled mean@k at the start, every `interval` steps,
    and at the end of the run: trainer/evaluator.py)."""

    size: int = Field(200, ge=0, description="Held-out prompts per source (at most); 0 = no evaluation.")
    interval: int = Field(
        0,
        ge=0,
        description="Evaluate the student every this many steps (and at the last step), each point in "
        "eval.json and the metrics; 0 = at the start and the end only.",
    )
    samples: int = Field(
        0,
        ge=0,
        description="k of the sampled mean@k: responses per held-out prompt at rollout.sampling's temperature "
        "and top_p, mean accuracy over them; 0 = greedy pass@1 only.",
    )
    seed: int = Field(
        DEFAULT_EVAL_SEED,
        ge=0,
        description="Seed of the held-out split; its items [seed, seed + size) must not overlap "
        "the training items [run seed, run seed + steps·batch_size).",
    )


class DataConfig(Section):
    """Prompt sources, how they are mixed, and the batch shape."""

    sources: list[SourceConfig] = Field(min_length=1, description="Prompt sources, each with its route.")
    mixture: Literal["proportional", "uniform", "weighted"] = Field(
        "uniform",
        description="'proportional' to source size; 'uniform' over sources (shorter ones cycle); "
        "'weighted' by each source's `weight`.",
    )
    batch_size: int = Field(ge=1, description="Prompts per training step.")
    samples_per_prompt: int = Field(1, ge=1, description="Rollouts per prompt (GRPO group size).")
    max_prompt_tokens: int = Field(ge=1, description="Longest prompt, in tokens; longer prompts are errors.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation split.")

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        problems = []
        first: dict[str, int] = {}
        for i, source in enumerate(self.sources):
            if source.name in first:
                problems.append(
                    Problem(
                        join_path("sources", i, "name"),
                        "duplicate source name",
                        source.name,
                        f"already used by data.sources[{first[source.name]}]",
                    )
                )
            first.setdefault(source.name, i)
            if self.mixture == "weighted" and source.weight is None:
                problems.append(
                    Problem(
                        join_path("sources", i, "weight"),
                        "mixture 'weighted' needs a weight on every source",
                        None,
                        "a number > 0",
                    )
                )
            if self.mixture != "weighted" and source.weight is not None:
                problems.append(
                    Problem(
                        join_path("sources", i, "weight"),
                        f"weights apply only to mixture 'weighted' (mixture is {self.mixture!r})",
                        source.weight,
                        "remove it, or set data.mixture: weighted",
                    )
                )
        raise_if_any(problems)
        return self

    @property
    def routes_used(self) -> tuple[str, ...]:
        """Routes named by the sources, in source order, de-duplicated."""
        return tuple(dict.fromkeys(s.route for s in self.sources))


def unevaluated_sources(data: DataConfig) -> list[Problem]:
    """Sources the held-out evaluation (data.eval, size > 0) leaves out, one problem each.

    The held-out prompts are drawn per reasoning-gym source, from its task at data.eval.seed
    (trainer/data_setup.py eval_prompts); a jsonl source has a held-out split only with `eval_fraction` or
    `eval_path`, so without them its prompts, and a route that only such sources feed, are never evaluated.
    """
    if data.eval.size == 0:
        return []
    evaluated = {s.route for s in data.sources if s.kind == "reasoning_gym" or s.held_out}
    out = []
    for i, source in enumerate(data.sources):
        if source.kind == "reasoning_gym" or source.held_out:
            continue
        route = (
            f"route {source.route!r} is evaluated on its held-out sources only"
            if source.route in evaluated
            else f"route {source.route!r} gets no evaluation"
        )
        out.append(
            Problem(
                join_path("data", "sources", i),
                f"source {source.name!r} (kind {source.kind}) is left out of the held-out evaluation "
                f"(data.eval.size {data.eval.size}): it has no held-out split; {route}",
                expected="eval_fraction or eval_path on the source, or data.eval.size: 0 to silence this",
            )
        )
    return out
