"""Walk the config's type tree by YAML path: which keys a section knows, what type sits at a path.

Used to turn pydantic's error locations into YAML paths with the known keys of the section (for
"unknown key" errors) and to check `--set a.b=1` paths against the schema before applying them.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel

#: The walk reached a free-form value (`task_args`, a dict of Any): every key below is accepted.
FREE: Any = Any


class UnknownKey(LookupError):
    """A path part that the schema does not have; `known` lists what it does have."""

    def __init__(self, key: str | int, known: tuple[str, ...]) -> None:
        self.key = key
        self.known = known
        super().__init__(f"unknown key {key!r}")


def strip(tp: Any) -> Any:
    """Drop Annotated[...] and Optional's None: `Annotated[X | None, ...]` → X (or a union of several)."""
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return strip(args[0])
        return Union[tuple(strip(a) for a in args)]  # noqa: UP007 (a runtime-built union)
    return tp


def union_members(tp: Any) -> tuple[type[BaseModel], ...]:
    """The model classes of a (discriminated) union of models; () for anything else."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        members = tuple(a for a in typing.get_args(tp) if isinstance(a, type) and issubclass(a, BaseModel))
        return members
    return ()


def tag_of(model: type[BaseModel], discriminator: str = "kind") -> str | None:
    """The Literal value of a union member's discriminator field (`kind: Literal['jsonl']` → 'jsonl')."""
    field = model.model_fields.get(discriminator)
    if field is None or typing.get_origin(field.annotation) is not Literal:
        return None
    return str(typing.get_args(field.annotation)[0])


def pick_member(tp: Any, data: object) -> Any:
    """For a union of models, the member that `data` (a dict with 'kind') selects; else `tp` unchanged."""
    members = union_members(tp)
    if members and isinstance(data, dict):
        for member in members:
            if tag_of(member) == data.get("kind"):
                return member
    return tp


def known_keys(tp: Any) -> tuple[str, ...]:
    """Keys of a model (or of every member of a union of models), in declaration order."""
    tp = strip(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tuple(tp.model_fields)
    keys: dict[str, None] = {}
    for member in union_members(tp):
        keys.update(dict.fromkeys(member.model_fields))
    return tuple(keys)


def child(tp: Any, key: str | int, data: object = None) -> Any:
    """The type at `key` below `tp`; `data` is the value at `tp` (selects a union member).

    Raises:
        UnknownKey: `key` is not a field of the model, or an int where no list is.
    """
    tp = pick_member(strip(tp), data)
    if tp is FREE:
        return FREE
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        if isinstance(key, str) and key in tp.model_fields:
            return tp.model_fields[key].annotation
        raise UnknownKey(key, known_keys(tp))
    if union_members(tp):
        for member in union_members(tp):
            if isinstance(key, str) and key in member.model_fields:
                return member.model_fields[key].annotation
        raise UnknownKey(key, known_keys(tp))
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (list, tuple) and isinstance(key, int):
        return args[0] if args else FREE
    if origin is dict and isinstance(key, str):
        return args[1] if len(args) == 2 else FREE
    if tp is dict:
        return FREE
    raise UnknownKey(key, ())


def field_description(tp: Any, key: str | int) -> str:
    """The `Field(description=...)` of `key` in model `tp` ("" when there is none)."""
    tp = strip(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel) and isinstance(key, str):
        field = tp.model_fields.get(key)
        return (field.description or "") if field else ""
    for member in union_members(tp):
        field = member.model_fields.get(key) if isinstance(key, str) else None
        if field is not None:
            return field.description or ""
    return ""
