"""The field tables of docs/en/mopd.md and docs/zh/mopd.md list every config field, and nothing else.

Walks the RunConfig type tree (`config/schema.py`): a field's YAML path, `[]` for list items, the members
of a (discriminated) union all under the same path; the het groups' fields under cluster.group.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel

from mopd_hpc.config import RunConfig
from mopd_hpc.config.schema import strip, union_members

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| `([^`]+)`[^|]*\|", re.MULTILINE)
#: The het groups' fields are one GroupConfig, documented once under cluster.group.
SAME_AS_GROUP = re.compile(r"^cluster\.(trainer|teacher|rollout)\.")


def models_of(tp: object) -> tuple[type[BaseModel], ...]:
    tp = strip(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return (tp,)
    return union_members(tp)


def field_paths(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, info in model.model_fields.items():
        path = prefix + name
        yield path
        tp = strip(info.annotation)
        if typing.get_origin(tp) in (list, tuple):
            for member in models_of(typing.get_args(tp)[0]):
                yield from field_paths(member, path + "[].")
        else:
            for member in models_of(tp):
                yield from field_paths(member, path + ".")


@pytest.mark.parametrize("doc", ["docs/en/mopd.md", "docs/zh/mopd.md"])
def test_docs_list_every_config_field(doc: str) -> None:
    want = {SAME_AS_GROUP.sub("cluster.group.", p) for p in field_paths(RunConfig)}
    rows = set(ROW.findall((ROOT / doc).read_text(encoding="utf-8")))
    assert len(want) > 80  # the walk reached the nested sections
    assert sorted(want - rows) == [], f"{doc}: fields without a row"
    assert sorted(rows - want) == [], f"{doc}: rows of fields that do not exist"
