"""Model compatibility before training: shared tokenizer, consistent teacher architectures.

- Tokenizer fingerprint: the id → token map (vocabulary and added tokens), the added tokens' `special`
  flags, and the special-token ids (bos/eos/pad/unk) — read from an HF tokenizer directory
  (`tokenizer.json` with the `tokenizers` library and `tokenizer_config.json`; other layouts through
  transformers' AutoTokenizer). Every teacher must equal the actor: teacher log-probs of the student's
  token ids are meaningless otherwise.
- Architecture fingerprint: `config.json` minus keys that do not describe the model (AReaL
  feature/mopd compatibility.py). All teachers must share one architecture (one persistent scoring
  engine reloads checkpoints in place); the actor's may differ.

A mismatch raises an error naming both models and the first differing token or key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: config.json keys that describe loading/runtime, not the network (AReaL's list plus HF runtime flags).
NON_MODEL_KEYS = frozenset(
    {
        "_name_or_path",
        "name_or_path",
        "_commit_hash",
        "_attn_implementation",
        "attn_implementation",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "use_cache",
        "id2label",
        "label2id",
        "tokenizer_class",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "torchscript",
    }
)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class CompatibilityError(ValueError):
    """Models that cannot be trained together."""


class ModelFilesError(CompatibilityError):
    """A model directory lacks the files a fingerprint needs (callers may defer the check to job start)."""


class TokenizerMismatchError(CompatibilityError):
    """Two models' tokenizers differ."""


class ArchitectureMismatchError(CompatibilityError):
    """Two teachers' architectures differ."""


def _digest(payload: Any) -> str:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class TokenizerFingerprint:
    """`id_to_token` (id, token) sorted by id; `added` (id, token, special); `special_ids` (key, id|None)."""

    name: str
    id_to_token: tuple[tuple[int, str], ...]
    added: tuple[tuple[int, str, bool], ...]
    special_ids: tuple[tuple[str, int | None], ...]

    @property
    def digest(self) -> str:
        return _digest([self.id_to_token, self.added, self.special_ids])


@dataclass(frozen=True, slots=True)
class ArchitectureFingerprint:
    """`config` is config.json without NON_MODEL_KEYS, as sorted (key, canonical JSON value) pairs."""

    name: str
    config: tuple[tuple[str, str], ...]

    @property
    def digest(self) -> str:
        return _digest(self.config)


def _token_text(token: Any) -> str | None:
    if token is None or isinstance(token, str):
        return token
    if isinstance(token, Mapping):
        return token.get("content")
    return str(token)


def tokenizer_fingerprint(path: str | Path, *, name: str | None = None) -> TokenizerFingerprint:
    """Fingerprint the tokenizer in directory `path` (`name` defaults to the path).

    Raises:
        ModelFilesError: no readable tokenizer in `path`.
    """
    path = Path(path)
    name = name or str(path)
    config_file = path / "tokenizer_config.json"
    tok_config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        vocab = tok.get_vocab(with_added_tokens=True)
        added = {i: (t.content, bool(t.special)) for i, t in tok.get_added_tokens_decoder().items()}
        to_id = tok.token_to_id
    else:
        try:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelFilesError(f"model {name!r}: no tokenizer readable in {path} ({exc})") from exc
        vocab = hf.get_vocab()
        added = {i: (t.content, bool(t.special)) for i, t in hf.added_tokens_decoder.items()}
        to_id = hf.convert_tokens_to_ids
    for i, (content, special) in _added_from_config(tok_config).items():
        added.setdefault(i, (content, special))
    special_ids = []
    for key in SPECIAL_TOKEN_KEYS:
        text = _token_text(tok_config.get(key))
        special_ids.append((key, None if text is None else to_id(text)))
    return TokenizerFingerprint(
        name=name,
        id_to_token=tuple(sorted((i, t) for t, i in vocab.items())),
        added=tuple(sorted((i, c, s) for i, (c, s) in added.items())),
        special_ids=tuple(special_ids),
    )


def _added_from_config(tok_config: Mapping[str, Any]) -> dict[int, tuple[str, bool]]:
    decoder = tok_config.get("added_tokens_decoder") or {}
    return {int(i): (str(t.get("content")), bool(t.get("special", False))) for i, t in decoder.items()}


def architecture_fingerprint(path: str | Path, *, name: str | None = None) -> ArchitectureFingerprint:
    """Fingerprint `path`/config.json without NON_MODEL_KEYS.

    Raises:
        ModelFilesError: config.json is missing or not a JSON object.
    """
    path = Path(path)
    name = name or str(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelFilesError(f"model {name!r}: {config_file} not found")
    config = json.loads(config_file.read_text())
    if not isinstance(config, dict):
        raise ModelFilesError(f"model {name!r}: {config_file} is not a JSON object")
    items = ((k, json.dumps(v, sort_keys=True)) for k, v in config.items() if k not in NON_MODEL_KEYS)
    return ArchitectureFingerprint(name=name, config=tuple(sorted(items)))


def first_tokenizer_difference(a: TokenizerFingerprint, b: TokenizerFingerprint) -> str | None:
    """The first difference between two tokenizers, in words, or None when they are equal."""
    ta, tb = dict(a.id_to_token), dict(b.id_to_token)
    for i in sorted(ta.keys() | tb.keys()):
        if ta.get(i) != tb.get(i):
            return f"token id {i}: {a.name!r} has {ta.get(i)!r}, {b.name!r} has {tb.get(i)!r}"
    aa, ab = {x[0]: x for x in a.added}, {x[0]: x for x in b.added}
    for i in sorted(aa.keys() | ab.keys()):
        if aa.get(i) != ab.get(i):
            return f"added token id {i}: {a.name!r} has {aa.get(i)!r}, {b.name!r} has {ab.get(i)!r}"
    sa, sb = dict(a.special_ids), dict(b.special_ids)
    for key in SPECIAL_TOKEN_KEYS:
        if sa.get(key) != sb.get(key):
            return f"special token {key}: {a.name!r} has id {sa.get(key)}, {b.name!r} has id {sb.get(key)}"
    return None


def first_architecture_difference(a: ArchitectureFingerprint, b: ArchitectureFingerprint) -> str | None:
    """The first differing config.json key (sorted order), in words, or None when they are equal."""
    ca, cb = dict(a.config), dict(b.config)
    for key in sorted(ca.keys() | cb.keys()):
        if ca.get(key) != cb.get(key):
            return f"config key {key!r}: {a.name!r} has {ca.get(key)}, {b.name!r} has {cb.get(key)}"
    return None


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """A model to check: its `name` (teacher id or "actor"), checkpoint `path`, optional tokenizer path."""

    name: str
    path: str
    tokenizer_path: str | None = None


@dataclass(frozen=True, slots=True)
class CompatibilityReport:
    """What the check established: the shared tokenizer digest and each model's architecture digest."""

    tokenizer_digest: str
    architecture_digests: tuple[tuple[str, str], ...]


def compatibility_errors(
    actor: ModelFiles, teachers: Sequence[ModelFiles]
) -> list[tuple[int, CompatibilityError]]:
    """Every incompatibility, as (index in `teachers` of the teacher it concerns, the error): a teacher whose
    tokenizer differs from the actor's (`TokenizerMismatchError`), a teacher whose architecture differs from
    the first teacher's (`ArchitectureMismatchError`). `check_models` raises the first; `mopd-submit --check`
    names each one's config field (launch/model_check.py).

    Raises:
        ModelFilesError: a model's files are missing.
    """
    return _compare(actor, teachers)[2]


def _compare(
    actor: ModelFiles, teachers: Sequence[ModelFiles]
) -> tuple[TokenizerFingerprint, list[ArchitectureFingerprint], list[tuple[int, CompatibilityError]]]:
    """(the actor's tokenizer fingerprint, the architectures of the actor then each teacher, the errors)."""
    errors: list[tuple[int, CompatibilityError]] = []
    actor_tok = tokenizer_fingerprint(actor.tokenizer_path or actor.path, name=actor.name)
    archs = [architecture_fingerprint(actor.path, name=actor.name)]
    for i, teacher in enumerate(teachers):
        tok = tokenizer_fingerprint(teacher.tokenizer_path or teacher.path, name=teacher.name)
        diff = first_tokenizer_difference(actor_tok, tok)
        if diff is not None:
            message = (
                f"teacher {teacher.name!r} ({teacher.path}) does not share the tokenizer of actor "
                f"{actor.name!r} ({actor.path}): {diff}"
            )
            errors.append((i, TokenizerMismatchError(message)))
        archs.append(architecture_fingerprint(teacher.path, name=teacher.name))
    for i, other in enumerate(archs[2:], start=1):
        diff = first_architecture_difference(archs[1], other)
        if diff is not None:
            message = (
                f"teachers {archs[1].name!r} and {other.name!r} have different architectures: {diff}; "
                "all teachers must share one architecture"
            )
            errors.append((i, ArchitectureMismatchError(message)))
    return actor_tok, archs, errors


def check_models(actor: ModelFiles, teachers: Sequence[ModelFiles]) -> CompatibilityReport:
    """Check that every teacher shares the actor's tokenizer and the teachers one architecture.

    Raises:
        TokenizerMismatchError: a teacher's tokenizer differs from the actor's (both named, first token;
            raised before any architecture mismatch).
        ArchitectureMismatchError: two teachers' architectures differ (both named, first key).
        ModelFilesError: a model's files are missing (callers may defer the check to job start).
    """
    actor_tok, archs, errors = _compare(actor, teachers)
    tokenizer = [e for _, e in errors if isinstance(e, TokenizerMismatchError)]
    if errors:
        raise (tokenizer or [errors[0][1]])[0]
    return CompatibilityReport(
        tokenizer_digest=actor_tok.digest,
        architecture_digests=tuple((a.name, a.digest) for a in archs),
    )
