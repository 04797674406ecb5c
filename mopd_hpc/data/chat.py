"""Prompt → token ids: raw text, or the user turn of a chat through the tokenizer's chat template.

Every process that feeds a prompt to a model (the rollout phase, the held-out evaluation, the teachers'
greedy evaluation) encodes it here, with the one shared tokenizer (`models.tokenizer`, whose fingerprint
every model matches), so the student and the teachers see the same ids:

- raw (`prompt.chat` None): `tokenizer(text)["input_ids"]`, the tokenizer's special tokens added (`<bos>`
  first for the tiny models).
- chat: `messages = [{"role": "system", "content": system}]` (when a system prompt is set) +
  `[{"role": "user", "content": text}]`; the ids are Hugging Face's
  `tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)` tokenized
  with `add_special_tokens=False` (what `apply_chat_template(..., tokenize=True)` does: the template writes
  its own special tokens). `kwargs` are the source's `chat_template_kwargs`, the template's own switches
  (e.g. Qwen3's `enable_thinking`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mopd_hpc.data.errors import DataSourceError
from mopd_hpc.data.prompt import Prompt


def chat_messages(prompt: Prompt) -> list[dict[str, str]]:
    """The chat of a chat prompt: the system turn (if any), then the prompt's text as the user turn.

    Raises:
        DataSourceError: `prompt` is a raw prompt.
    """
    chat = prompt.chat
    if chat is None:
        raise DataSourceError(f"source {prompt.source!r}, row {prompt.index}: a raw prompt has no chat")
    system = chat.get("system")
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": prompt.text}]


def render_prompt(tokenizer: Any, prompt: Prompt) -> str:
    """The text the model sees: the raw text, or the chat template's rendering with the generation prompt.

    Raises:
        DataSourceError: a chat prompt and a tokenizer without a chat template, or a template that fails
            (the message names the source and the row).
    """
    chat = prompt.chat
    if chat is None:
        return prompt.text
    if not getattr(tokenizer, "chat_template", None):
        raise DataSourceError(
            f"source {prompt.source!r}: template 'chat' but the tokenizer ({tokenizer.name_or_path!r}) has no "
            "chat_template; set the source's template: raw, or use a tokenizer whose tokenizer_config.json "
            "(or chat_template.jinja) holds one"
        )
    try:
        return tokenizer.apply_chat_template(
            chat_messages(prompt), add_generation_prompt=True, tokenize=False, **chat.get("kwargs", {})
        )
    except Exception as exc:  # jinja2's TemplateError and whatever the template raises itself
        raise DataSourceError(
            f"source {prompt.source!r}, row {prompt.index}: the chat template failed: {type(exc).__name__}: {exc}"
        ) from exc


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of `prompt` as every model of the run sees it (module docstring). Raises as `render_prompt`."""
    if prompt.chat is None:
        return list(tokenizer(prompt.text)["input_ids"])
    return list(tokenizer(render_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"])


def encode_prompts(tokenizer: Any, prompts: Sequence[Prompt]) -> list[list[int]]:
    """`encode_prompt` of each prompt, in order; the raw ones in one batched tokenizer call."""
    raw = [i for i, p in enumerate(prompts) if p.chat is None]
    out: list[list[int]] = [[] for _ in prompts]
    if raw:
        for i, ids in zip(raw, tokenizer([prompts[i].text for i in raw])["input_ids"], strict=True):
            out[i] = list(ids)
    for i, p in enumerate(prompts):
        if p.chat is not None:
            out[i] = encode_prompt(tokenizer, p)
    return out


def has_chat_template(directory: str | os.PathLike[str]) -> bool:
    """Whether the tokenizer directory holds a chat template where transformers looks for one: a non-empty
    `chat_template` in tokenizer_config.json, or a `chat_template.jinja` / `chat_template.json` file (read from
    the files, transformers not imported: `mopd-submit --check` calls it)."""
    d = Path(directory)
    if (d / "chat_template.jinja").is_file() or (d / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))
