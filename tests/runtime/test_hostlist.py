"""Slurm hostlist and task-count lists: known expansions, errors naming the input, round trips."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mopd_hpc.runtime.hostlist import (
    HostlistError,
    compress_counts,
    compress_hostlist,
    expand_counts,
    expand_hostlist,
)


@pytest.mark.parametrize(
    ("expr", "hosts"),
    [
        ("n[01-04,07],gpu-a[1-2]", ["n01", "n02", "n03", "n04", "n07", "gpu-a1", "gpu-a2"]),
        ("n1", ["n1"]),
        ("n[2-3]", ["n2", "n3"]),
        ("compute[042-043,045]", ["compute042", "compute043", "compute045"]),  # submitit test_slurm_node_list
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("r[1-2]n[08-09]-ib", ["r1n08-ib", "r1n09-ib", "r2n08-ib", "r2n09-ib"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("a,b[5],c", ["a", "b5", "c"]),
        (" node[001-002] ", ["node001", "node002"]),
        ("n1,n1", ["n1", "n1"]),
        ("", []),
    ],
)
def test_expand_hostlist_known(expr: str, hosts: list[str]) -> None:
    assert expand_hostlist(expr) == hosts


@pytest.mark.parametrize(
    ("expr", "fragment"),
    [
        ("n[1-", "unbalanced '['"),
        ("n1]", "']' without '['"),
        ("n[[1]]", "nested '['"),
        ("n[]", "empty brackets"),
        ("n[3-1]", "runs backwards (3 > 1)"),
        ("n[a-b]", "bad range 'a-b'"),
        ("n1,,n2", "empty host name"),
        ("n[1-2000000]", "more than 1000000"),
        ("r[1-1000]n[1-2000]", "more than 1000000"),
    ],
)
def test_expand_hostlist_errors_name_the_input(expr: str, fragment: str) -> None:
    with pytest.raises(HostlistError) as info:
        expand_hostlist(expr)
    assert repr(expr) in str(info.value)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("hosts", "expr"),
    [
        (["n1", "n2", "n3", "n5"], "n[1-3,5]"),
        (["n01", "n02", "n10"], "n[01-02,10]"),
        (["n1", "m1", "n2"], "n1,m1,n2"),
        (["login"], "login"),
        (["r1n1-ib", "r1n2-ib"], "r1n[1-2]-ib"),
        (["n9", "n10"], "n[9-10]"),
        (["n09", "n10"], "n[09-10]"),
        (["n9", "n010"], "n[9,010]"),
        ([], ""),
    ],
)
def test_compress_hostlist_known(hosts: list[str], expr: str) -> None:
    assert compress_hostlist(hosts) == expr
    assert expand_hostlist(expr) == hosts


@pytest.mark.parametrize("bad", ["", "a,b", "n[1]", "n 1"])
def test_compress_hostlist_rejects_unrepresentable_names(bad: str) -> None:
    with pytest.raises(HostlistError, match="cannot be part of a hostlist"):
        compress_hostlist(["n1", bad])


_name = st.builds(
    lambda prefix, number, width, suffix: f"{prefix}{str(number).zfill(width)}{suffix}",
    st.sampled_from(["n", "gpu-a", "r1n", "node", "x"]),
    st.integers(0, 120),
    st.integers(1, 4),
    st.sampled_from(["", "-ib", "b"]),
)
_plain = st.text(alphabet="abcxyz-_.", min_size=1, max_size=6).filter(lambda s: s[-1].isalpha())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(_name, _plain), max_size=40))
def test_hostlist_round_trip(hosts: list[str]) -> None:
    assert expand_hostlist(compress_hostlist(hosts)) == hosts


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 130), min_size=1, max_size=50))
def test_sorted_runs_compress_to_ranges(numbers: list[int]) -> None:
    hosts = [f"n{n:03d}" for n in sorted(set(numbers))]
    expr = compress_hostlist(hosts)
    assert expand_hostlist(expr) == hosts
    assert expr.count("n") == 1  # one bracket group for one prefix


@pytest.mark.parametrize(
    ("expr", "counts"),
    [("2(x3),1", [2, 2, 2, 1]), ("1(x2)", [1, 1]), ("8", [8]), ("4,2(x2)", [4, 2, 2])],
)
def test_expand_counts(expr: str, counts: list[int]) -> None:
    assert expand_counts(expr) == counts
    assert compress_counts(counts) == expr


@pytest.mark.parametrize("bad", ["", "2(x0)", "x", "2(3)", "2,,1", "-1"])
def test_expand_counts_errors(bad: str) -> None:
    with pytest.raises(HostlistError) as info:
        expand_counts(bad)
    assert repr(bad) in str(info.value)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=30))
def test_counts_round_trip(counts: list[int]) -> None:
    assert expand_counts(compress_counts(counts)) == counts
