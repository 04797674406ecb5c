"""The `Prompt` record: one prompt drawn from a dataset source, with what is needed to score it.

A `Prompt` crosses process boundaries (controller → rollout server, actor → logs), so it is a
frozen, slotted dataclass of JSON scalars only: `to_dict()` / `from_dict()` round-trip exactly
through `json`, and the record is hashable. Task arguments and the reasoning-gym entry are held as
canonical JSON strings (sorted keys, compact) for that reason; `task_args` and `entry` parse them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from mopd_hpc.data.errors import PromptRecordError

SourceKind = Literal["reasoning_gym", "jsonl"]
SOURCE_KINDS: tuple[str, ...] = get_args(SourceKind)


def canonical_json(obj: Any) -> str:
    """Serialize `obj` as canonical JSON (sorted keys, no spaces, tuples become lists).

    Raises:
        PromptRecordError: `obj` holds something JSON cannot represent.
    """
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise PromptRecordError(f"value is not JSON-serializable: {exc} (got {obj!r})") from exc


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of a dataset source.

    Fields:
        kind: the source kind, `reasoning_gym` or `jsonl`; it selects the reward function.
        source: the source's name (`data.sources[].name` in run.yaml); the route is provenance kept
            beside the prompt by the routing layer, not a field here.
        index: 0-based index of the prompt within its source (and split).
        text: the formatted prompt the model sees (without special tokens), e.g. `5+1+8=`.
        answer: the reference answer, e.g. `14`; the SFT target of the tiny-model builder.
        task: the reasoning-gym task name (e.g. `chain_sum`); empty for jsonl.
        task_args_json: canonical JSON of the task's keyword arguments (`{}` for jsonl).
        entry_json: canonical JSON of the reasoning-gym entry (`question`, `answer`, `metadata`)
            passed to the dataset's `score_answer`; for jsonl `{"answer": ..., "prompt": ...}`.
        reward: what scores a completion (`mopd_hpc.data.rewards.score_completion`): a built-in
            (`reasoning_gym`, `exact`, `regex`, `math`) or a user's `module:function`.
        reward_pattern: the regex of reward `regex`; empty for every other reward.
        chat_json: empty for a raw prompt (the text is tokenized as it is); for a chat prompt, canonical
            JSON `{"system": str | null, "kwargs": {...}}`: the text is the user turn of a chat, encoded
            through the tokenizer's chat template (`mopd_hpc.data.chat.encode_prompt`).

    Build it with `Prompt.create(...)`, which canonicalizes the JSON fields; direct construction
    validates too (`__post_init__`).
    """

    kind: str
    source: str
    index: int
    text: str
    answer: str
    task: str
    task_args_json: str
    entry_json: str
    reward: str
    reward_pattern: str
    chat_json: str

    @classmethod
    def create(
        cls,
        *,
        kind: str,
        source: str,
        index: int,
        text: str,
        answer: str,
        task: str = "",
        task_args: dict[str, Any] | None = None,
        entry: dict[str, Any] | None = None,
        reward: str | None = None,
        reward_pattern: str = "",
        chat: dict[str, Any] | None = None,
    ) -> Prompt:
        """Build a validated `Prompt`; `task_args`, `entry` and `chat` are stored as canonical JSON.

        `reward` None is the kind's default (`DEFAULT_REWARD`: reasoning_gym / exact); `chat` None is a
        raw prompt, else `{"system": str | None, "kwargs": dict}`.

        Raises:
            PromptRecordError: an unknown kind, a negative index, an empty text, a non-string
                answer, a reasoning-gym prompt without a task, or non-JSON arguments/entry.
        """
        from mopd_hpc.config.rewards import DEFAULT_REWARD  # deferred: the config package costs ≈ 0.4 s

        return cls(
            kind=kind,
            source=source,
            index=index,
            text=text,
            answer=answer,
            task=task,
            task_args_json=canonical_json(task_args or {}),
            entry_json=canonical_json(entry or {}),
            reward=DEFAULT_REWARD.get(kind, "") if reward is None else reward,
            reward_pattern=reward_pattern,
            chat_json="" if chat is None else canonical_json(chat),
        )

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        if self.kind not in SOURCE_KINDS:
            raise PromptRecordError(f"Prompt.kind: unknown kind (got {self.kind!r}; known: {SOURCE_KINDS})")
        if not isinstance(self.index, int) or isinstance(self.index, bool) or self.index < 0:
            raise PromptRecordError(f"Prompt.index: must be an int >= 0 (got {self.index!r})")
        for name in (
            "source",
            "text",
            "answer",
            "task",
            "task_args_json",
            "entry_json",
            "reward",
            "reward_pattern",
            "chat_json",
        ):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise PromptRecordError(
                    f"Prompt.{name}: must be a str (got {value!r}, {type(value).__name__})"
                )
        if not self.text:
            raise PromptRecordError(
                f"Prompt.text: must not be empty (source {self.source!r}, index {self.index})"
            )
        if self.kind == "reasoning_gym" and not self.task:
            raise PromptRecordError(
                f"Prompt.task: a reasoning_gym prompt needs a task name (got {self.task!r})"
            )
        self._validate_reward()
        for name in ("task_args_json", "entry_json", "chat_json"):
            if name == "chat_json" and not self.chat_json:
                continue
            try:
                parsed = json.loads(getattr(self, name))
            except json.JSONDecodeError as exc:
                raise PromptRecordError(f"Prompt.{name}: not valid JSON ({exc})") from exc
            if not isinstance(parsed, dict):
                raise PromptRecordError(f"Prompt.{name}: must encode a JSON object (got {parsed!r})")

    def _validate_reward(self) -> None:
        from mopd_hpc.config.rewards import BUILTIN_REWARDS  # deferred, as in `create`

        if self.reward not in BUILTIN_REWARDS and ":" not in self.reward:
            raise PromptRecordError(
                f"Prompt.reward: expected one of {BUILTIN_REWARDS} or 'module:function' (got {self.reward!r})"
            )
        if self.reward == "reasoning_gym" and self.kind != "reasoning_gym":
            raise PromptRecordError(
                f"Prompt.reward: 'reasoning_gym' scores reasoning-gym prompts only (kind {self.kind!r})"
            )
        if (self.reward == "regex") != bool(self.reward_pattern):
            raise PromptRecordError(
                f"Prompt.reward_pattern: needed by reward 'regex' and by no other "
                f"(reward {self.reward!r}, pattern {self.reward_pattern!r})"
            )

    @property
    def chat(self) -> dict[str, Any] | None:
        """None for a raw prompt, else `{"system": str | None, "kwargs": dict}` (a fresh dict)."""
        return json.loads(self.chat_json) if self.chat_json else None

    @property
    def task_args(self) -> dict[str, Any]:
        """The task's keyword arguments (a fresh dict on every call)."""
        return json.loads(self.task_args_json)

    @property
    def entry(self) -> dict[str, Any]:
        """The dataset entry passed to the reward function (a fresh dict on every call)."""
        return json.loads(self.entry_json)

    def to_dict(self) -> dict[str, Any]:
        """The record as a dict of JSON scalars (`json.dumps`-ready)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Prompt:
        """Rebuild a record from `to_dict()` output.

        Raises:
            PromptRecordError: missing or unknown keys, or an invalid field.
        """
        fields = set(cls.__dataclass_fields__)
        missing, unknown = sorted(fields - set(data)), sorted(set(data) - fields)
        if missing or unknown:
            raise PromptRecordError(
                f"Prompt.from_dict: missing keys {missing}, unknown keys {unknown} (got {data!r})"
            )
        return cls(**data)
