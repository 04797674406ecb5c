"""A routed mixture of named dataset sources: a deterministic, resumable stream of routed samples.

Each source has a name, a route (which teacher weights apply: provenance carried *beside* the sample in
`RoutedSample`, never a key written into it) and a dataset (anything with `__len__` and `__getitem__`,
e.g. a reasoning-gym dataset). Mixture policies:

- `proportional`: each epoch visits every sample of every source once, in one seeded shuffle of their
  union, so sources appear in proportion to their sizes.
- `uniform`: sources take turns (s0, s1, …, s0, s1, …); each source walks its own seeded shuffle and
  reshuffles when it runs out, so shorter sources cycle and every source is drawn equally often.
- `weighted`: draw i picks source s with probability p_s (given, normalized here) from a counter-based
  hash of (seed, i); within a source, as for `uniform`.

The stream is a pure function of (sources' sizes, policy, weights, seed, position): `state_dict()` holds
the position, and `load_state_dict()` on an identically built dataset continues the same stream.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

MixturePolicy = Literal["proportional", "uniform", "weighted"]
POLICIES: tuple[str, ...] = ("proportional", "uniform", "weighted")


class RoutingError(ValueError):
    """A bad source, policy, weight or saved state."""


class Source(Protocol):
    """What a dataset source must offer."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> Any: ...


@dataclass(frozen=True, slots=True)
class RoutedSource:
    """A named source and the route its samples take."""

    name: str
    route: str
    dataset: Source


@dataclass(frozen=True, slots=True)
class RoutedSample:
    """A sample with its provenance: `route` (teacher weights key), `source` name, `index` in the
    source, and the untouched `sample` itself."""

    route: str
    source: str
    index: int
    sample: Any


def _seed_of(*parts: object) -> int:
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: a valid torch.Generator seed


def _permutation(n: int, *parts: object) -> list[int]:
    gen = torch.Generator().manual_seed(_seed_of(*parts))
    return torch.randperm(n, generator=gen).tolist()


class RoutedDataset:
    """An infinite, deterministic stream of `RoutedSample` over named sources.

    Args:
        sources: the sources, in a fixed order (the order is part of the stream's definition).
        policy: "proportional", "uniform" or "weighted".
        seed: the stream's seed.
        weights: source name → probability (any positive scale), required for and only for "weighted".

    Raises:
        RoutingError: no sources, duplicate names, an empty source, an unknown policy, or weights that
            are missing/extra/negative/all zero.
    """

    def __init__(
        self,
        sources: Sequence[RoutedSource],
        *,
        policy: MixturePolicy,
        seed: int,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        if not sources:
            raise RoutingError("sources is empty; expected at least one RoutedSource")
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise RoutingError(f"source names {names} repeat; expected unique names")
        for s in sources:
            if len(s.dataset) == 0:
                raise RoutingError(f"source {s.name!r} (route {s.route!r}) is empty; expected >= 1 sample")
        if policy not in POLICIES:
            raise RoutingError(f"policy is {policy!r}; expected one of {list(POLICIES)}")
        self._sources = tuple(sources)
        self._sizes = tuple(len(s.dataset) for s in sources)
        self._policy = policy
        self._seed = int(seed)
        self._probs = self._check_weights(policy, names, weights)
        self._position = 0
        self._drawn = [0] * len(sources)  # per-source draws so far (uniform/weighted)
        self._perm_cache: dict[tuple[object, ...], list[int]] = {}

    @staticmethod
    def _check_weights(
        policy: str, names: list[str], weights: Mapping[str, float] | None
    ) -> tuple[float, ...] | None:
        if policy != "weighted":
            if weights is not None:
                raise RoutingError(f"weights given for policy {policy!r}; only 'weighted' takes weights")
            return None
        if weights is None or set(weights) != set(names):
            raise RoutingError(
                f"weights keys {sorted(weights or {})}; expected exactly the source names {sorted(names)}"
            )
        if any(not (math.isfinite(w) and w >= 0) for w in weights.values()) or not any(
            w > 0 for w in weights.values()
        ):
            raise RoutingError(f"weights {dict(weights)}; expected finite >= 0 with at least one > 0")
        total = sum(weights.values())
        return tuple(weights[n] / total for n in names)

    @property
    def sources(self) -> tuple[RoutedSource, ...]:
        return self._sources

    @property
    def position(self) -> int:
        """Number of samples drawn so far."""
        return self._position

    def _cached_perm(self, n: int, *key: object) -> list[int]:
        if key not in self._perm_cache:
            if len(self._perm_cache) > 2 * len(self._sources) + 2:
                self._perm_cache.clear()
            self._perm_cache[key] = _permutation(n, self._seed, *key)
        return self._perm_cache[key]

    def _within_source(self, s: int) -> int:
        k = self._drawn[s]
        self._drawn[s] += 1
        size = self._sizes[s]
        return self._cached_perm(size, "source", self._sources[s].name, k // size)[k % size]

    def _next_coordinates(self) -> tuple[int, int]:
        i = self._position
        if self._policy == "proportional":
            total = sum(self._sizes)
            flat = self._cached_perm(total, "epoch", i // total)[i % total]
            for s, size in enumerate(self._sizes):
                if flat < size:
                    return s, flat
                flat -= size
            raise AssertionError("unreachable: flat index beyond the sources' total size")
        if self._policy == "uniform":
            s = i % len(self._sources)
        else:
            u = _seed_of(self._seed, "draw", i) / 2**63
            s, acc = len(self._probs) - 1, 0.0  # type: ignore[arg-type]
            for j, p in enumerate(self._probs):  # type: ignore[arg-type]
                acc += p
                if u < acc:
                    s = j
                    break
        return s, self._within_source(s)

    def __iter__(self) -> RoutedDataset:
        return self

    def __next__(self) -> RoutedSample:
        s, index = self._next_coordinates()
        self._position += 1
        src = self._sources[s]
        return RoutedSample(route=src.route, source=src.name, index=index, sample=src.dataset[index])

    def take(self, n: int) -> list[RoutedSample]:
        """The next `n` samples of the stream."""
        return [next(self) for _ in range(n)]

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable position of the stream plus what defines it (checked on load)."""
        return {
            "policy": self._policy,
            "seed": self._seed,
            "sources": [[s.name, s.route, size] for s, size in zip(self._sources, self._sizes, strict=True)],
            "weights": list(self._probs) if self._probs is not None else None,
            "position": self._position,
            "drawn": list(self._drawn),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the stream saved by `state_dict()`.

        Raises:
            RoutingError: the state was saved by a dataset with other sources, sizes, policy, weights or seed.
        """
        mine = self.state_dict()
        for key in ("policy", "seed", "sources", "weights"):
            theirs = state.get(key)
            if key == "sources" and theirs is not None:
                theirs = [list(x) for x in theirs]
            if theirs != mine[key]:
                raise RoutingError(
                    f"saved stream has {key}={theirs!r} but this dataset has {key}={mine[key]!r}; "
                    "rebuild the dataset exactly as when the state was saved"
                )
        drawn = list(state["drawn"])
        if len(drawn) != len(self._sources):
            raise RoutingError(f"saved drawn counts {drawn}; expected {len(self._sources)} entries")
        self._position = int(state["position"])
        self._drawn = [int(d) for d in drawn]
