"""Routed mixtures: provenance beside the sample, policies' frequencies, determinism, resume."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mopd_hpc.mopd.routing import RoutedDataset, RoutedSample, RoutedSource, RoutingError


class Numbers:
    """A minimal source: `__len__` and `__getitem__` only."""

    def __init__(self, tag: str, n: int) -> None:
        self.tag, self.n = tag, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, object]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return {"question": f"{self.tag}-{index}"}


def sources(sizes: dict[str, int]) -> list[RoutedSource]:
    return [
        RoutedSource(name=name, route=f"route_{name}", dataset=Numbers(name, n)) for name, n in sizes.items()
    ]


def keys(samples: list[RoutedSample]) -> list[tuple[str, int]]:
    return [(s.source, s.index) for s in samples]


def test_route_is_provenance_beside_the_sample() -> None:
    ds = RoutedDataset(sources({"math": 3, "code": 2}), policy="uniform", seed=0)
    sample = next(ds)
    assert isinstance(sample, RoutedSample)
    assert sample.route == f"route_{sample.source}"
    assert sample.sample == {"question": f"{sample.source}-{sample.index}"}  # the sample is untouched
    assert "route" not in sample.sample
    with pytest.raises(AttributeError):
        sample.route = "other"  # type: ignore[misc]


def test_proportional_visits_every_sample_once_per_epoch() -> None:
    ds = RoutedDataset(sources({"a": 5, "b": 3, "c": 1}), policy="proportional", seed=7)
    epoch1, epoch2 = ds.take(9), ds.take(9)
    assert sorted(keys(epoch1)) == sorted(
        [("a", i) for i in range(5)] + [("b", i) for i in range(3)] + [("c", 0)]
    )
    assert sorted(keys(epoch2)) == sorted(keys(epoch1))
    assert keys(epoch2) != keys(epoch1)  # reshuffled each epoch


def test_uniform_cycles_shorter_sources() -> None:
    ds = RoutedDataset(sources({"big": 6, "small": 2}), policy="uniform", seed=3)
    stream = ds.take(12)
    counts = Counter(s.source for s in stream)
    assert counts == {"big": 6, "small": 6}
    small = [s.index for s in stream if s.source == "small"]
    assert sorted(small[:2]) == [0, 1] and sorted(small[2:4]) == [0, 1] and sorted(small[4:]) == [0, 1]
    assert sorted(s.index for s in stream if s.source == "big") == list(range(6))


def test_weighted_frequencies_within_binomial_bounds() -> None:
    weights = {"a": 1.0, "b": 3.0, "c": 6.0}  # unnormalized: p = 0.1, 0.3, 0.6
    ds = RoutedDataset(sources({"a": 4, "b": 50, "c": 7}), policy="weighted", seed=11, weights=weights)
    n = 20_000
    counts = Counter(s.source for s in ds.take(n))
    for name, w in weights.items():
        p = w / 10
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(counts[name] - n * p) < 5 * sigma, (name, counts[name], n * p)


@settings(max_examples=25, deadline=None)
@given(
    policy=st.sampled_from(["proportional", "uniform", "weighted"]),
    seed=st.integers(0, 2**40),
    split=st.integers(0, 40),
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=4),
)
def test_resume_gives_the_same_stream(policy, seed, split, sizes) -> None:
    named = {f"s{i}": n for i, n in enumerate(sizes)}
    weights = {name: 1.0 + i for i, name in enumerate(named)} if policy == "weighted" else None

    def build() -> RoutedDataset:
        return RoutedDataset(sources(named), policy=policy, seed=seed, weights=weights)

    reference = keys(build().take(split + 30))
    first = build()
    head = keys(first.take(split))
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = build()
    resumed.load_state_dict(state)
    assert head + keys(resumed.take(30)) == reference
    assert keys(build().take(split + 30)) == reference  # deterministic under the seed


def test_different_seed_gives_a_different_stream() -> None:
    a = RoutedDataset(sources({"a": 20, "b": 20}), policy="proportional", seed=1).take(40)
    b = RoutedDataset(sources({"a": 20, "b": 20}), policy="proportional", seed=2).take(40)
    assert keys(a) != keys(b)


def test_errors() -> None:
    with pytest.raises(RoutingError, match="is empty"):
        RoutedDataset(sources({"a": 0}), policy="uniform", seed=0)
    with pytest.raises(RoutingError, match="policy is 'random'"):
        RoutedDataset(sources({"a": 1}), policy="random", seed=0)  # type: ignore[arg-type]
    with pytest.raises(RoutingError, match="expected exactly the source names"):
        RoutedDataset(sources({"a": 1, "b": 1}), policy="weighted", seed=0, weights={"a": 1.0})
    with pytest.raises(RoutingError, match="only 'weighted' takes weights"):
        RoutedDataset(sources({"a": 1}), policy="uniform", seed=0, weights={"a": 1.0})
    ds = RoutedDataset(sources({"a": 3}), policy="uniform", seed=0)
    other = RoutedDataset(sources({"a": 4}), policy="uniform", seed=0)
    with pytest.raises(RoutingError, match="saved stream has sources"):
        other.load_state_dict(ds.state_dict())
