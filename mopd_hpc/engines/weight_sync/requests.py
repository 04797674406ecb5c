"""Weight-update request records of the rollout HTTP surface (SGLang 0.5.23 `io_struct.py`; notes:
../shared/reference/algo_awex.md §3.2): /init_weights_update_group and /update_weights_from_distributed.

The actor's sender (`torch.py`) builds them, the rollout servers validate them (`from_json`, a bad field
raises `RolloutRequestError`: HTTP 400); both import them from here, so weight sync never imports the
rollout servers. No torch, no aiohttp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from mopd_hpc.engines.request_fields import (
    RolloutRequestError,
    bool_field,
    fail,
    int_field,
    json_object,
    reject_unknown,
    str_field,
)

#: SGLang's default group name of /init_weights_update_group.
DEFAULT_GROUP_NAME = "weight_update_group"
#: Dtype names accepted in /update_weights_from_distributed (`getattr(torch, name)` on the receiver).
DTYPE_NAMES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
)


@dataclass(frozen=True, slots=True)
class InitGroupRequest:
    """Body of /init_weights_update_group: the server joins as rank `rank_offset` (tp = 1); trainer is 0."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "nccl"

    @classmethod
    def from_json(cls, body: Any) -> InitGroupRequest:
        body = json_object("body", body)
        known = ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend")
        reject_unknown("/init_weights_update_group body", body, known)
        port = int_field("master_port", body.get("master_port"), 1)
        if port > 65535:
            raise fail("master_port", port, "a TCP port in [1, 65535]")
        world = int_field("world_size", body.get("world_size"), 2)
        rank = int_field("rank_offset", body.get("rank_offset"), 1)
        if rank >= world:
            raise fail("rank_offset", rank, f"a rank in [1, world_size={world}) (rank 0 is the trainer)")
        backend = body.get("backend", "nccl")
        if backend not in ("nccl", "gloo"):
            raise fail("backend", backend, "'nccl' or 'gloo'")
        return cls(
            master_address=str_field("master_address", body.get("master_address")),
            master_port=port,
            rank_offset=rank,
            world_size=world,
            group_name=str_field("group_name", body.get("group_name", DEFAULT_GROUP_NAME)),
            backend=backend,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": self.rank_offset,
            "world_size": self.world_size,
            "group_name": self.group_name,
            "backend": self.backend,
        }


@dataclass(frozen=True, slots=True)
class DistributedUpdateRequest:
    """Body of /update_weights_from_distributed: tensors broadcast from rank 0, in this order.

    load_format None: one broadcast per tensor; "flattened_bucket": one broadcast per dtype, the tensors
    of that dtype flattened and concatenated in request order.
    """

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str = DEFAULT_GROUP_NAME
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    load_format: str | None = None

    @classmethod
    def from_json(cls, body: Any) -> DistributedUpdateRequest:
        body = json_object("body", body)
        known = ("names", "dtypes", "shapes", "group_name", "weight_version", "flush_cache")
        known += ("abort_all_requests", "load_format", "selector", "torch_empty_cache")
        reject_unknown("/update_weights_from_distributed body", body, known)
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        for field, value in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
            if not isinstance(value, list) or not value:
                raise fail(field, value, "a non-empty list")
        if not len(names) == len(dtypes) == len(shapes):
            raise RolloutRequestError(
                f"names, dtypes, shapes: lengths {len(names)}, {len(dtypes)}, {len(shapes)} differ"
            )
        for dtype in dtypes:
            if dtype not in DTYPE_NAMES:
                raise fail("dtypes[]", dtype, f"one of {list(DTYPE_NAMES)}")
        for shape in shapes:
            if not isinstance(shape, list):
                raise fail("shapes[]", shape, "a list of dimension sizes")
        load_format = body.get("load_format")
        if load_format not in (None, "flattened_bucket"):
            raise fail("load_format", load_format, "null or 'flattened_bucket'")
        if body.get("selector", "target") != "target":
            raise fail("selector", body["selector"], "'target' (no draft model in the hf backend)")
        version = body.get("weight_version")
        return cls(
            names=tuple(str_field("names[]", n) for n in names),
            dtypes=tuple(dtypes),
            shapes=tuple(tuple(int_field("shapes[][]", d, 0) for d in s) for s in shapes),
            group_name=str_field("group_name", body.get("group_name", DEFAULT_GROUP_NAME)),
            weight_version=None if version is None else str_field("weight_version", str(version)),
            flush_cache=bool_field("flush_cache", body.get("flush_cache", True)),
            abort_all_requests=bool_field("abort_all_requests", body.get("abort_all_requests", False)),
            load_format=load_format,
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "names": list(self.names),
            "dtypes": list(self.dtypes),
            "shapes": [list(s) for s in self.shapes],
            "group_name": self.group_name,
            "flush_cache": self.flush_cache,
            "abort_all_requests": self.abort_all_requests,
        }
        if self.weight_version is not None:
            out["weight_version"] = self.weight_version
        if self.load_format is not None:
            out["load_format"] = self.load_format
        return out


class WeightUpdateClient(Protocol):
    """What the actor's sender calls on each rollout server (`engines/rollout/client.py`'s `RolloutClient` is
    one): the three weight-update endpoints, each answering the server's JSON. Declared here so that weight
    sync needs no import of the rollout package."""

    async def init_weights_update_group(self, req: InitGroupRequest) -> dict[str, Any]: ...

    async def update_weights_from_distributed(self, req: DistributedUpdateRequest) -> dict[str, Any]: ...

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> dict[str, Any]: ...
