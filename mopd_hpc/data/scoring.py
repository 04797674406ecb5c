"""`Scoring`: what a source puts on each of its prompts besides the text: its reward and its prompt template.

One frozen record per source, built from its run.yaml entry (`Scoring.from_source_config`), handed to the
source, which stamps `prompt_fields()` onto every `Prompt` it makes (`reward`, `reward_pattern`, `chat`): so
whoever holds a prompt (the rollout phase, the held-out evaluation, another process) scores and encodes it
as its source said, with nothing else to look up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Scoring:
    """A source's reward and prompt template.

    Fields:
        reward: None for the kind's default (`mopd_hpc.config.rewards.DEFAULT_REWARD`), else a built-in
            (`reasoning_gym`, `exact`, `regex`, `math`) or a user's `module:function`.
        reward_pattern: the regex of reward `regex` ("" otherwise).
        template: `raw` (the text tokenized as it is) or `chat` (through the tokenizer's chat template).
        system_prompt: the chat's system turn, or None for none (chat only).
        chat_template_kwargs: extra variables of the chat template, e.g. `{"enable_thinking": False}` for
            Qwen3 (chat only).
    """

    reward: str | None = None
    reward_pattern: str = ""
    template: str = "raw"
    system_prompt: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_source_config(cls, spec: Any) -> Scoring:
        """From a `data.sources[]` entry of the run config (`mopd_hpc.config.data`)."""
        return cls(
            reward=spec.reward,
            reward_pattern=spec.reward_pattern or "",
            template=spec.template,
            system_prompt=spec.system_prompt,
            chat_template_kwargs=dict(spec.chat_template_kwargs),
        )

    def prompt_fields(self) -> dict[str, Any]:
        """The keyword arguments of `Prompt.create` this scoring sets: reward, reward_pattern, chat."""
        chat = (
            {"system": self.system_prompt, "kwargs": dict(self.chat_template_kwargs)}
            if self.template == "chat"
            else None
        )
        return {"reward": self.reward, "reward_pattern": self.reward_pattern, "chat": chat}
