"""The files a child reads from a model directory, opened and checked on the submit host.

What every child reads (transformers' `from_pretrained`, the tokenizer, the teachers' scoring engines) is
checked here so that a damaged file is named before the queue wait, not by a bare traceback ("EOF while
parsing") in every child after it started:

- `config.json` (a model directory): a JSON object with a `model_type` string (what AutoConfig needs);
- the tokenizer's JSON files present (`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`,
  `added_tokens.json`, `vocab.json`), each parsed whole; a directory with none of `tokenizer.json`,
  `vocab.json`, `tokenizer.model` has no tokenizer;
- the weights (a model directory): `model.safetensors.index.json` (every shard it names present, every
  tensor it maps found in that shard's header), else the `*.safetensors` files, else `pytorch_model.bin`.
  Of a safetensors file only the header is read (8-byte little-endian length n, then n bytes of JSON; the
  format of huggingface/safetensors): each tensor's byte range must equal its shape × dtype size, and the
  file's size must equal 8 + n + the end of the last tensor (a shorter file is truncated, a longer one is
  refused by safetensors too). A `pytorch_model.bin` zip must have a readable central directory (at its end:
  a truncated file has none).

`directory_problems(path, tokenizer=..., weights=...)` returns one sentence per problem, each naming the
file and what is wrong; the caller (launch/model_check.py) prefixes the config field.
"""

from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path

#: Tokenizer files that are JSON (parsed whole when present).
TOKENIZER_JSON = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
)
#: Any one of these makes a directory hold a tokenizer (fast, BPE vocabulary, sentencepiece).
TOKENIZER_MAIN = ("tokenizer.json", "vocab.json", "tokenizer.model")
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
#: Bytes per element of each safetensors dtype (huggingface/safetensors `Dtype`); others are not size-checked.
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}
#: Largest safetensors header accepted (safetensors' own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000


def read_json(path: Path) -> tuple[object, str | None]:
    """(the parsed value, None), or (None, what is wrong: truncated JSON, not JSON, unreadable)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{path}: unreadable ({exc})"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        if not text.strip() or exc.pos >= len(text.rstrip()):
            return None, f"{path}: truncated JSON ({len(text)} characters end inside the value: {exc.msg})"
        return None, f"{path}: not valid JSON ({exc})"


def config_problems(directory: Path) -> list[str]:
    """config.json missing, not JSON, not an object, or without a `model_type` string."""
    path = directory / "config.json"
    if not path.is_file():
        return [f"{path}: missing (every model directory needs its config.json)"]
    value, error = read_json(path)
    if error is not None:
        return [error]
    if not isinstance(value, dict):
        return [f"{path}: expected a JSON object, got {type(value).__name__}"]
    if not isinstance(value.get("model_type"), str):
        return [f'{path}: no "model_type" string (transformers\' AutoConfig needs it)']
    return []


def tokenizer_problems(directory: Path) -> list[str]:
    """A tokenizer JSON file that does not parse; or no tokenizer file at all."""
    out = []
    for name in TOKENIZER_JSON:
        path = directory / name
        if path.is_file():
            _, error = read_json(path)
            if error is not None:
                out.append(error)
    if not any((directory / name).is_file() for name in TOKENIZER_MAIN):
        out.append(f"{directory}: no tokenizer ({', '.join(TOKENIZER_MAIN)}: none found)")
    return out


def safetensors_header(path: Path) -> tuple[dict[str, object], str | None]:
    """(tensor name → {dtype, shape, data_offsets}, None) or ({}, what is wrong with the file)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return {}, f"{path}: {size} bytes, shorter than the 8-byte header length: truncated"
        n = int.from_bytes(head, "little")
        if n > min(size - 8, MAX_HEADER_BYTES):
            return (
                {},
                f"{path}: header length {n} but the file has {size} bytes: truncated or not safetensors",
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return {}, f"{path}: its {n}-byte header is not JSON ({exc}): not a safetensors file"
    if not isinstance(header, dict):
        return {}, f"{path}: its header is not a JSON object: not a safetensors file"
    end = 0
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, info in tensors.items():
        try:
            dtype, shape, (begin, stop) = info["dtype"], info["shape"], info["data_offsets"]
            count = math.prod(int(d) for d in shape)
        except (KeyError, TypeError, ValueError):
            return {}, f"{path}: tensor {name!r} has a malformed header entry {info!r:.120}"
        width = DTYPE_BYTES.get(str(dtype))
        if width is not None and stop - begin != count * width:
            return {}, (
                f"{path}: tensor {name!r} ({dtype} {list(shape)}) spans {stop - begin} bytes; "
                f"expected {count * width}"
            )
        end = max(end, int(stop))
    expected = 8 + n + end
    if size < expected:
        return {}, f"{path}: {size} bytes but its header describes {expected}: truncated"
    if size > expected:
        return (
            {},
            f"{path}: {size} bytes but its header describes {expected}: {size - expected} trailing bytes",
        )
    return tensors, None


def weights_problems(directory: Path) -> list[str]:
    """The weights of a model directory (module docstring): missing, truncated, or inconsistent."""
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        value, error = read_json(index)
        if error is not None:
            return [error]
        weight_map = value.get("weight_map") if isinstance(value, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            return [f'{index}: no "weight_map" object']
        by_file: dict[str, set[str]] = {}
        for tensor, file in weight_map.items():
            by_file.setdefault(str(file), set()).add(str(tensor))
        out = []
        for file, names in by_file.items():
            shard = directory / file
            if not shard.is_file():
                out.append(f"{shard}: missing (named by {index.name})")
                continue
            tensors, error = safetensors_header(shard)
            if error is not None:
                out.append(error)
            elif absent := sorted(names - set(tensors)):
                out.append(
                    f"{shard}: lacks {len(absent)} tensor(s) {index.name} maps to it, e.g. {absent[0]!r}"
                )
        return out
    shards = sorted(directory.glob("*.safetensors"))
    if shards:
        return [e for s in shards if (e := safetensors_header(s)[1]) is not None]
    binary = directory / TORCH_BIN
    if binary.is_file():
        try:
            with zipfile.ZipFile(binary):
                pass
        except (zipfile.BadZipFile, OSError) as exc:
            return [f"{binary}: not a readable torch zip ({exc}): truncated or damaged"]
        return []
    return [f"{directory}: no weights ({SAFETENSORS_INDEX}, *.safetensors or {TORCH_BIN})"]


def directory_problems(directory: str | Path, *, tokenizer: bool, weights: bool) -> list[str]:
    """Every problem of the files a child reads from `directory`: its tokenizer (when `tokenizer`), its
    config.json and weights (when `weights`: a model, not a tokenizer-only directory)."""
    path = Path(directory)
    out = []
    if weights:
        out += config_problems(path)
    if tokenizer:
        out += tokenizer_problems(path)
    if weights:
        out += weights_problems(path)
    return out
