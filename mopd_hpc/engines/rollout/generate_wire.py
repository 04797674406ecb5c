"""A /generate answer as tensors (`GeneratedBatch`), and its frame (`engines/frames/codec.py`) for binary transport.

The rollout server answers SGLang's JSON by default; a client that sends `Accept:
application/x-mopd-tensors` gets one frame instead (the trainer's `RolloutClient` does). Shape legend: R
response items (prompt-major: copy j of prompt i at i·n + j), N = Σ_r |output_r| generated tokens.

    output_ids       [N] int32 (int64 if an id exceeds 2**31 − 1)  the items' tokens, item after item
    output_lengths   [R] int64                                      |output_r|
    output_logprobs  [N] float32 (float64 when a value is not float32-exact)  log μ of each token; absent
                     when the request did not ask for log-probs
    routed_experts   [N, M, k] int16                                each token's expert ids in the M MoE layers
                     (`return_routed_experts`; JSON: meta_info.routed_experts [|output|][M][k]); absent when
                     not asked
    meta             {"is_batch": bool, "items": [per item: {"text", "meta_info"} without output_ids and
                     meta_info.output_token_logprobs]}

What else an item holds (finish_reason, ids, versions; input_token_logprobs and top log-probs when asked)
stays in the item's JSON. `to_sglang()` rebuilds SGLang's JSON answer exactly; `samples()` the trainer's
`GeneratedSample`s, equal to `GeneratedSample.from_response` of the JSON answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mopd_hpc.engines.frames.codec import Frame, FrameLayout, WireError, layout
from mopd_hpc.engines.request_fields import RolloutRequestError
from mopd_hpc.engines.rollout.protocol import DEFAULT_WEIGHT_VERSION, GeneratedSample

_INT32_MAX = 2**31 - 1


def _ids_tensor(values: list[int]) -> torch.Tensor:
    ids = torch.tensor(values, dtype=torch.int64)
    return ids.to(torch.int32) if ids.numel() == 0 or int(ids.max()) <= _INT32_MAX else ids


def _logprob_tensor(values: list[float]) -> torch.Tensor:
    """float32 when every value survives the cast exactly (float32 engines), else float64."""
    wide = torch.tensor(values, dtype=torch.float64)
    narrow = wide.to(torch.float32)
    exact = (narrow.double() == wide) | (wide.isnan() & narrow.isnan())
    return narrow if bool(exact.all()) else wide


@dataclass(frozen=True, slots=True)
class GeneratedBatch:
    """R generated items, tokens packed (module docstring for shapes and dtypes).

    Attributes:
        output_ids: [N] int32 or int64.
        output_lengths: [R] int64.
        output_logprobs: [N] float32 or float64 log μ(output_ids), or None when not asked.
        items: per item, its JSON object without output_ids and meta_info.output_token_logprobs.
        is_batch: SGLang answers a list (True) or the single item (False).
        routed_experts: [N, M, k] int16 expert ids, or None when not asked.
    """

    output_ids: torch.Tensor
    output_lengths: torch.Tensor
    output_logprobs: torch.Tensor | None
    items: tuple[Mapping[str, Any], ...]
    is_batch: bool
    routed_experts: torch.Tensor | None = None

    @classmethod
    def from_results(
        cls,
        items: Sequence[Mapping[str, Any]],
        output_ids: Sequence[Sequence[int]],
        output_logprobs: Sequence[Sequence[float]] | None,
        is_batch: bool,
        routed_experts: Sequence[Sequence[torch.Tensor]] | None = None,
    ) -> GeneratedBatch:
        """From a server's results: the items without the packed fields, and per item its ids, (when asked)
        its log-probs (one per id) and its routed experts (one [M, k] tensor per id)."""
        lengths = torch.tensor([len(r) for r in output_ids], dtype=torch.int64)
        lps = None
        if output_logprobs is not None:
            lps = _logprob_tensor([v for r in output_logprobs for v in r])
        routed = None
        if routed_experts is not None:
            flat = [t for r in routed_experts for t in r]
            routed = torch.stack(flat).to(torch.int16) if flat else torch.zeros((0, 0, 0), dtype=torch.int16)
        ids = _ids_tensor([t for r in output_ids for t in r])
        return cls(ids, lengths, lps, tuple(items), is_batch, routed)

    @classmethod
    def from_sglang(cls, answer: Any) -> GeneratedBatch:
        """From SGLang's JSON answer (an item or a list of items).

        Raises:
            RolloutRequestError: an item without output_ids/meta_info; output_token_logprobs on some items
                only; or output_token_logprobs whose ids differ from output_ids.
        """
        is_batch = isinstance(answer, list)
        raw = answer if is_batch else [answer]
        for k, item in enumerate(raw):
            if not isinstance(item, Mapping) or "output_ids" not in item or "meta_info" not in item:
                raise RolloutRequestError(
                    f"response item {k}: expected an object with output_ids and meta_info"
                )
        has = [item["meta_info"].get("output_token_logprobs") is not None for item in raw]
        if any(has) and not all(has):
            raise RolloutRequestError(f"output_token_logprobs on items {has}: expected on all items or none")
        with_logprobs = bool(raw) and all(has)
        with_routes = bool(raw) and all(item["meta_info"].get("routed_experts") is not None for item in raw)
        routes: list[list[list[int]]] = []
        ids: list[int] = []
        lps: list[float] = []
        lengths, items = [], []
        for item in raw:
            out = [int(t) for t in item["output_ids"]]
            meta = dict(item["meta_info"])
            if with_logprobs:
                triples = meta.pop("output_token_logprobs")
                if [int(t[1]) for t in triples] != out:
                    raise RolloutRequestError(
                        f"response {meta.get('id')}: output_token_logprobs ids != output_ids"
                    )
                lps.extend(float(t[0]) for t in triples)
            if with_routes:
                routes.extend(meta.pop("routed_experts"))
            ids.extend(out)
            lengths.append(len(out))
            items.append({key: v for key, v in item.items() if key != "output_ids"} | {"meta_info": meta})
        return cls(
            output_ids=_ids_tensor(ids),
            output_lengths=torch.tensor(lengths, dtype=torch.int64),
            output_logprobs=_logprob_tensor(lps) if with_logprobs else None,
            items=tuple(items),
            is_batch=is_batch,
            routed_experts=torch.tensor(routes, dtype=torch.int16) if with_routes and routes else None,
        )

    @classmethod
    def from_frame(cls, frame: Frame) -> GeneratedBatch:
        """Validate an answer frame. Raises WireError: a missing tensor or meta field, a count mismatch."""
        ids = frame.tensor("output_ids", (torch.int32, torch.int64), 1)
        lengths = frame.tensor("output_lengths", (torch.int64,), 1)
        items, is_batch = frame.meta.get("items"), frame.meta.get("is_batch")
        if (
            not isinstance(items, list)
            or not all(isinstance(i, dict) for i in items)
            or type(is_batch) is not bool
        ):
            raise WireError("meta: expected items (a list of objects) and is_batch (a bool)")
        if len(items) != lengths.numel() or bool((lengths < 0).any()) or int(lengths.sum()) != ids.numel():
            raise WireError(
                f"{len(items)} items, output_lengths {lengths.numel()} summing to {int(lengths.sum())}, "
                f"output_ids {ids.numel()}: expected one length per item summing to the ids"
            )
        lps = None
        if "output_logprobs" in frame.tensors:
            lps = frame.tensor("output_logprobs", (torch.float32, torch.float64), 1)
            if lps.numel() != ids.numel():
                raise WireError(f"output_logprobs holds {lps.numel()} values; output_ids {ids.numel()}")
        routed = None
        if "routed_experts" in frame.tensors:
            routed = frame.tensor("routed_experts", (torch.int16,), 3)
            if routed.shape[0] != ids.numel():
                raise WireError(f"routed_experts holds {routed.shape[0]} tokens; output_ids {ids.numel()}")
        return cls(ids, lengths, lps, tuple(items), is_batch, routed)

    def layout(self) -> FrameLayout:
        """The answer frame's layout (module docstring); `.encode()` gives its bytes."""
        tensors = {"output_ids": self.output_ids, "output_lengths": self.output_lengths}
        if self.output_logprobs is not None:
            tensors["output_logprobs"] = self.output_logprobs
        if self.routed_experts is not None:
            tensors["routed_experts"] = self.routed_experts
        return layout(tensors, {"is_batch": self.is_batch, "items": list(self.items)})

    def encode(self) -> memoryview:
        """The answer frame's bytes."""
        return self.layout().encode()

    def _per_item(self, values: torch.Tensor) -> list[list[Any]]:
        return [r.tolist() for r in values.split(self.output_lengths.tolist())]

    def to_sglang(self) -> Any:
        """SGLang's JSON answer, exactly as the server gives it without binary transport."""
        ids = self._per_item(self.output_ids)
        lps = None if self.output_logprobs is None else self._per_item(self.output_logprobs)
        routes = None if self.routed_experts is None else self._per_item(self.routed_experts)
        out = []
        for k, item in enumerate(self.items):
            meta = dict(item["meta_info"])
            if routes is not None:
                meta["routed_experts"] = routes[k]
            if lps is not None:
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps[k], ids[k], strict=True)]
            out.append(dict(item) | {"output_ids": ids[k], "meta_info": meta})
        return out if self.is_batch else out[0]

    def samples(self, prompts: Sequence[Sequence[int]], n: int) -> list[GeneratedSample]:
        """The trainer's samples: item k is copy k mod n of prompts[k // n].

        Raises:
            RolloutRequestError: the answer does not hold len(prompts) × n items.
        """
        if len(self.items) != len(prompts) * n:
            raise RolloutRequestError(
                f"answer holds {len(self.items)} items; expected {len(prompts)} prompts × n={n}"
            )
        ids = self._per_item(self.output_ids)
        lps = None if self.output_logprobs is None else self._per_item(self.output_logprobs)
        routes = None
        if self.routed_experts is not None:
            routes = (
                self.routed_experts.split(self.output_lengths.tolist())
                if self.routed_experts.numel()
                else None
            )
        out = []
        for k, item in enumerate(self.items):
            meta = item["meta_info"]
            out.append(
                GeneratedSample(
                    prompt_ids=tuple(int(t) for t in prompts[k // n]),
                    output_ids=tuple(ids[k]),
                    behavior_logprobs=() if lps is None else tuple(lps[k]),
                    finish_reason=str(meta["finish_reason"]["type"]),
                    weight_version=str(meta.get("weight_version", DEFAULT_WEIGHT_VERSION)),
                    text=str(item.get("text") or ""),
                    rid=str(meta.get("id", "")),
                    routed_experts=None if routes is None else routes[k],
                )
            )
        return out
