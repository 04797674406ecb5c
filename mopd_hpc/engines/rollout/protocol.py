"""Records of the rollout HTTP surface: the SGLang 0.5.23 subset the trainer needs (DESIGN.md §5).

Request and response shapes follow SGLang 0.5.23 `sglang/srt/managers/io_struct.py` and
`entrypoints/http_server.py` (notes: ../shared/reference/algo_awex.md §3.2). Every record is frozen and
built by a named constructor that validates (`from_json`); a bad field raises `RolloutRequestError`, which
the server answers with 400 and the field, the value and what was expected.

Control-plane records live in `control.py` (memory tags) and `engines/weight_sync/requests.py` (weight
updates); field validation in `engines/request_fields.py`. This module imports neither
torch nor aiohttp: the controller, the server and the client share it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mopd_hpc.engines.request_fields import (
    RolloutRequestError,
    bool_field,
    fail,
    float_field,
    int_field,
    json_object,
    reject_unknown,
    str_field,
)

__all__ = [
    "DEFAULT_WEIGHT_VERSION",
    "GREEDY_TEMPERATURE",
    "GenerateRequest",
    "GeneratedSample",
    "SamplingParams",
]

#: SGLang's default weight version of a freshly loaded server.
DEFAULT_WEIGHT_VERSION = "default"
#: Sampling params accepted only at their neutral value (anything else would change what SGLang samples).
_NEUTRAL_SAMPLING = {
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "min_new_tokens": 0,
    "stop": None,
    "logit_bias": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "custom_params": None,
}
#: Sampling params that only shape the detokenized text: accepted and ignored.
_TEXT_ONLY_SAMPLING = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
#: Top-level /generate fields accepted and ignored (routing and bookkeeping of a multi-engine SGLang).
_IGNORED_GENERATE = (
    "return_text_in_logprobs",
    "lora_path",
    "priority",
    "custom_logit_processor",
    "routed_dp_rank",
    "data_parallel_rank",
    "log_metrics",
    "return_hidden_states",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """SGLang `sampling_params` subset, validated.

    temperature 0 (or top_k 1) is greedy decoding, as in SGLang (`_SAMPLING_EPS` = 1e-6). top_k -1 = off.
    n copies of a prompt get seeds sampling_seed + j (j = 0..n-1); without sampling_seed the server draws
    seeds from its own RNG (`--random-seed`).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling_seed: int | None = None
    n: int = 1

    @classmethod
    def from_json(cls, body: Any, field: str = "sampling_params") -> SamplingParams:
        """Validate a JSON `sampling_params` object; unsupported non-neutral fields raise."""
        body = json_object(field, body)
        own = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos")
        own += ("sampling_seed", "n")
        reject_unknown(field, body, own + tuple(_NEUTRAL_SAMPLING) + _TEXT_ONLY_SAMPLING)
        for key, neutral in _NEUTRAL_SAMPLING.items():
            value = body.get(key, neutral)
            if value != neutral and not (neutral is None and value in ([], "", {})):
                raise fail(f"{field}.{key}", value, f"{neutral!r} (not supported by the hf rollout backend)")
        stop = body.get("stop_token_ids") or []
        if not isinstance(stop, list):
            raise fail(f"{field}.stop_token_ids", stop, "a list of token ids")
        seed = body.get("sampling_seed")
        return cls(
            max_new_tokens=int_field(f"{field}.max_new_tokens", body.get("max_new_tokens", 128), 0),
            temperature=cls._temperature(field, body.get("temperature", 1.0)),
            top_p=cls._top_p(field, body.get("top_p", 1.0)),
            top_k=cls._top_k(field, body.get("top_k", -1)),
            stop_token_ids=tuple(int_field(f"{field}.stop_token_ids[]", t, 0) for t in stop),
            ignore_eos=bool_field(f"{field}.ignore_eos", body.get("ignore_eos", False)),
            sampling_seed=None if seed is None else int_field(f"{field}.sampling_seed", seed),
            n=int_field(f"{field}.n", body.get("n", 1), 1),
        )

    @staticmethod
    def _temperature(field: str, value: Any) -> float:
        t = float_field(f"{field}.temperature", value)
        if t < 0:
            raise fail(f"{field}.temperature", value, "a number >= 0 (0 = greedy)")
        return t

    @staticmethod
    def _top_p(field: str, value: Any) -> float:
        p = float_field(f"{field}.top_p", value)
        if not 0 < p <= 1:
            raise fail(f"{field}.top_p", value, "a number in (0, 1]")
        return p

    @staticmethod
    def _top_k(field: str, value: Any) -> int:
        k = int_field(f"{field}.top_k", value)
        if k == 0 or k < -1:
            raise fail(f"{field}.top_k", value, "-1 (off) or an integer >= 1")
        return k

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature < 1e-6 or top_k == 1)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def to_json(self) -> dict[str, Any]:
        """The SGLang `sampling_params` object."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "n": self.n,
        }
        if self.sampling_seed is not None:
            out["sampling_seed"] = self.sampling_seed
        return out


#: Below this temperature decoding is greedy (SGLang `_SAMPLING_EPS`).
GREEDY_TEMPERATURE = 1e-6


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A validated POST /generate body.

    `prompts` holds token ids (from `input_ids`) or is None when the body gave `text` (the server
    tokenizes). `sampling[i]` applies to prompt i. `is_batch` is True when the input was a list of
    prompts: the response is then a list (also when n > 1), prompt-major: item i·n + j is copy j of
    prompt i.
    """

    prompts: tuple[tuple[int, ...], ...] | None
    texts: tuple[str, ...] | None
    is_batch: bool
    sampling: tuple[SamplingParams, ...]
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    rids: tuple[str, ...] | None
    #: Each generated token's routed experts per MoE layer (SGLang's `return_routed_experts`; an MoE model).
    return_routed_experts: bool = False

    @classmethod
    def from_json(cls, body: Any) -> GenerateRequest:
        body = json_object("body", body)
        known = ("input_ids", "text", "sampling_params", "return_logprob", "logprob_start_len")
        known += ("top_logprobs_num", "rid", "stream", "return_routed_experts")
        reject_unknown("/generate body", body, known + _IGNORED_GENERATE)
        if body.get("stream"):
            raise fail("stream", body["stream"], "false (streaming is not supported by the hf backend)")
        has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
        if has_ids == has_text:
            raise RolloutRequestError("/generate body: give exactly one of 'input_ids' and 'text'")
        prompts, texts = None, None
        if has_ids:
            prompts, is_batch = cls._parse_ids(body["input_ids"])
            count = len(prompts)
        else:
            texts, is_batch = cls._parse_texts(body["text"])
            count = len(texts)
        sampling = cls._parse_sampling(body.get("sampling_params"), count)
        rids = body.get("rid")
        if rids is not None:
            rid_list = [rids] if isinstance(rids, str) else rids
            if not isinstance(rid_list, list) or len(rid_list) != count:
                raise fail("rid", rids, f"a string or a list of {count} strings")
            rids = tuple(str_field("rid[]", r) for r in rid_list)
        return cls(
            prompts=prompts,
            texts=texts,
            is_batch=is_batch,
            sampling=sampling,
            return_logprob=bool_field("return_logprob", body.get("return_logprob", False)),
            logprob_start_len=int_field("logprob_start_len", body.get("logprob_start_len", -1), -1),
            top_logprobs_num=int_field("top_logprobs_num", body.get("top_logprobs_num", 0), 0),
            rids=rids,
            return_routed_experts=bool_field(
                "return_routed_experts", body.get("return_routed_experts", False)
            ),
        )

    @staticmethod
    def _parse_ids(value: Any) -> tuple[tuple[tuple[int, ...], ...], bool]:
        if not isinstance(value, list) or not value:
            raise fail("input_ids", value, "a non-empty list of token ids or a list of such lists")
        if all(isinstance(v, list) for v in value):
            for i, ids in enumerate(value):
                if not ids:
                    raise fail(f"input_ids[{i}]", ids, "a non-empty list of token ids")
            return tuple(
                tuple(int_field(f"input_ids[{i}][]", t, 0) for t in ids) for i, ids in enumerate(value)
            ), True
        return (tuple(int_field("input_ids[]", t, 0) for t in value),), False

    @staticmethod
    def _parse_texts(value: Any) -> tuple[tuple[str, ...], bool]:
        if isinstance(value, str):
            return (value,), False
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return tuple(value), True
        raise fail("text", value, "a string or a non-empty list of strings")

    @staticmethod
    def _parse_sampling(value: Any, count: int) -> tuple[SamplingParams, ...]:
        if isinstance(value, list):
            if len(value) != count:
                raise fail("sampling_params", value, f"one object or a list of {count} objects")
            return tuple(SamplingParams.from_json(v, f"sampling_params[{i}]") for i, v in enumerate(value))
        return (SamplingParams.from_json(value),) * count

    @property
    def num_prompts(self) -> int:
        return len(self.prompts if self.prompts is not None else self.texts or ())


@dataclass(frozen=True, slots=True)
class GeneratedSample:
    """One generated response, as the trainer consumes it.

    behavior_logprobs[t] is log μ(output_ids[t]) in float32 precision: the log-probability of the
    sampled token under the exact distribution it was sampled from (see `sampling.py`). Empty when the
    request did not ask for log-probs. routed_experts: [|output|, M, k] int16 torch tensor of the expert
    ids each token was routed to in the M MoE layers (at the position whose logits gave it), or None when
    not asked (rollout routing replay).
    """

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    behavior_logprobs: tuple[float, ...]
    finish_reason: str
    weight_version: str
    text: str = ""
    rid: str = ""
    routed_experts: Any = None

    @classmethod
    def from_response(cls, item: Mapping[str, Any], prompt_ids: Sequence[int]) -> GeneratedSample:
        """Build from one SGLang-shaped response item ({text, output_ids, meta_info})."""
        meta = item["meta_info"]
        triples = meta.get("output_token_logprobs") or []
        output_ids = tuple(int(t) for t in item["output_ids"])
        if triples and [int(t[1]) for t in triples] != list(output_ids):
            raise RolloutRequestError(f"response {meta.get('id')}: output_token_logprobs ids != output_ids")
        return cls(
            prompt_ids=tuple(int(t) for t in prompt_ids),
            output_ids=output_ids,
            behavior_logprobs=tuple(float(t[0]) for t in triples),
            finish_reason=str(meta["finish_reason"]["type"]),
            weight_version=str(meta.get("weight_version", DEFAULT_WEIGHT_VERSION)),
            text=str(item.get("text") or ""),
            rid=str(meta.get("id", "")),
        )
