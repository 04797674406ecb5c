"""The shared character-level tokenizer of the tiny models (HF `tokenizers`, loadable by AutoTokenizer).

One token per character of `CHARSET` (digits, lowercase letters, `+ - = , ` and space: 41) after
four specials (`<pad>` 0, `<bos>` 1, `<eos>` 2, `<unk>` 3): 45 tokens
(reference/tiny_calibration.md, "Tokenizer"). A WordLevel model over a per-character Split
pre-tokenizer; a Fuse decoder joins characters back without spaces; the post-processor puts
`<bos>` before every encoded text (`add_special_tokens=False` leaves it out). Any other character
encodes as `<unk>`.

Every model the builder writes carries identical tokenizer files, so the compatibility check
(same vocab and added tokens) holds by construction; `tokenizer_fingerprint` hashes exactly that.
"""

from __future__ import annotations

import hashlib
import json
import os
import string
from pathlib import Path
from typing import Any

from mopd_hpc.atomic import atomic_write_json

CHARSET = string.digits + string.ascii_lowercase + "+-=, "
"""The 41 ordinary characters, in vocabulary order after the specials."""
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARSET)
MODEL_MAX_LENGTH = 256
"""Longest sequence (tokens) the tiny models take; their `max_position_embeddings`."""

TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def char_vocab() -> dict[str, int]:
    """`{token: id}`: the specials, then `CHARSET` in order."""
    return {token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARSET))}


def build_char_tokenizer() -> Any:
    """A `transformers` fast tokenizer over the character vocabulary (deterministic: no training)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=char_vocab(), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        model_max_length=MODEL_MAX_LENGTH,
    )


def save_char_tokenizer(tokenizer: Any, directory: str | os.PathLike[str]) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `directory`.

    `tokenizer_config.json` names `PreTrainedTokenizerFast`, which every transformers since 4.x
    loads with `AutoTokenizer.from_pretrained(directory)`.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.update(
        tokenizer_class="PreTrainedTokenizerFast", model_max_length=MODEL_MAX_LENGTH, padding_side="right"
    )
    config.pop("backend", None)
    atomic_write_json(out / "tokenizer_config.json", config)
    special = {"pad_token": PAD, "bos_token": BOS, "eos_token": EOS, "unk_token": UNK}
    atomic_write_json(out / "special_tokens_map.json", special)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 (hex) of the vocabulary and the added tokens of a loaded tokenizer.

    Two tokenizers with the same fingerprint map every text to the same ids.
    """
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    added = sorted((int(i), str(t)) for i, t in tokenizer.added_tokens_decoder.items())
    blob = json.dumps({"vocab": vocab, "added": added}, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()
