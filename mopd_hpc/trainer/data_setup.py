"""The run's data: the routed training stream and the held-out evaluation prompts, built from `data:`.

Training stream: one `mopd_hpc.data` source per `data.sources[]` entry (reasoning-gym task or jsonl file),
each under its route, mixed by `RoutedDataset` with `data.mixture` and the run seed. A reasoning-gym source
holds `steps · batch_size` items (RNG seeds seed + [0, steps·batch_size)): every draw of the run has its own
item and the resumable stream's per-source permutation stays small (a 10⁹-item source would need a 10⁹-long
permutation).

Held-out prompts: for each reasoning-gym source, `data.eval.size` items with RNG seeds
data.eval.seed + [0, size) (the config rule keeps them apart from the training seeds). A jsonl source with
`eval_fraction` holds out ⌈fraction·rows⌉ of its rows (drawn by data.eval.seed, `data/holdout.py`), which the
training stream then never draws; one with `eval_path` is evaluated on that file's rows; either way the first
`data.eval.size` held-out rows are evaluated. A jsonl source without either is not evaluated (its route only
through its other sources, if any; `--check` warns). Every held-out prompt is scored by its source's `score`
(`RunData.score`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mopd_hpc.config import RunConfig
from mopd_hpc.data import Prompt, PromptSource, ReasoningGymSource, make_source
from mopd_hpc.data.holdout import RowSubset, held_out_file, scorer_name, split_rows
from mopd_hpc.data.scoring import Scoring
from mopd_hpc.mopd.routing import RoutedDataset, RoutedSource


@dataclass(frozen=True, slots=True)
class RunData:
    """The training stream and what scores and evaluates it.

    Attributes:
        dataset: the routed, resumable training stream.
        sources: source name → the source (its `score(prompt, completion)` is the reward).
        eval_prompts: route → held-out prompts of that route (routes without any are absent).
    """

    dataset: RoutedDataset
    sources: Mapping[str, PromptSource]
    eval_prompts: Mapping[str, tuple[Prompt, ...]]

    def score(self, prompt: Prompt, completion: str) -> float:
        """The reward of `completion` by the source `prompt` comes from (a held-out prompt's: its source's).

        Raises:
            KeyError: a prompt of no source of the run.
        """
        return float(self.sources[scorer_name(prompt.source)].score(prompt, completion))


def train_size(cfg: RunConfig) -> int:
    """Items per reasoning-gym training source: enough for every draw of the run."""
    return max(1, cfg.steps * cfg.data.batch_size)


def build_run_data(cfg: RunConfig) -> RunData:
    """Build the sources, the stream and the held-out prompts of `cfg`.

    Raises:
        DataSourceError: a source cannot be built (unknown task, unreadable jsonl file, ...).
        RoutingError: the mixture cannot be built (e.g. an empty source).
    """
    sources: dict[str, PromptSource] = {}
    held: dict[str, PromptSource] = {}
    routed = []
    for spec in cfg.data.sources:
        source: PromptSource
        if spec.kind == "reasoning_gym":
            source = make_source(
                "reasoning_gym",
                spec.name,
                task=spec.task,
                task_args=spec.task_args,
                seed=cfg.seed,
                size=train_size(cfg),
                scoring=Scoring.from_source_config(spec),
            )
        else:
            source = make_source("jsonl", spec.name, path=spec.path, scoring=Scoring.from_source_config(spec))
            if spec.eval_fraction is not None:
                source, held[spec.name] = split_rows(source, spec.eval_fraction, cfg.data.eval.seed)
            elif spec.eval_path is not None and cfg.data.eval.size > 0:
                held[spec.name] = held_out_file(source, spec.eval_path, Scoring.from_source_config(spec))
        sources[spec.name] = source
        routed.append(RoutedSource(spec.name, spec.route, source))
    weights: dict[str, float] | None = None
    if cfg.data.mixture == "weighted":
        weights = {s.name: float(s.weight or 0.0) for s in cfg.data.sources}
    dataset = RoutedDataset(routed, policy=cfg.data.mixture, seed=cfg.seed, weights=weights)
    return RunData(dataset=dataset, sources=sources, eval_prompts=eval_prompts(cfg, held))


def eval_prompts(
    cfg: RunConfig, held: Mapping[str, PromptSource] | None = None
) -> dict[str, tuple[Prompt, ...]]:
    """route → held-out prompts (module docstring), in source order; {} when data.eval.size is 0.

    Args:
        held: source name → the held-out split of a jsonl source (`build_run_data` makes them).
    """
    size = cfg.data.eval.size
    out: dict[str, list[Prompt]] = {}
    if size == 0:
        return {}
    for spec in cfg.data.sources:
        split: PromptSource | RowSubset
        if spec.kind == "reasoning_gym":
            # split "train" with seed = eval.seed: RNG seeds eval.seed + [0, size), as data.eval documents.
            split = ReasoningGymSource.create(
                f"{spec.name}/eval",
                spec.task,
                spec.task_args,
                seed=cfg.data.eval.seed,
                split="train",
                size=size,
                scoring=Scoring.from_source_config(spec),
            )
        elif held and spec.name in held:
            split = held[spec.name]
        else:
            continue
        out.setdefault(spec.route, []).extend(split[i] for i in range(min(size, len(split))))
    return {route: tuple(prompts) for route, prompts in out.items()}


def route_sources(cfg: RunConfig) -> dict[str, list[str]]:
    """route → names of its sources, in config order."""
    out: dict[str, list[str]] = {}
    for spec in cfg.data.sources:
        out.setdefault(spec.route, []).append(spec.name)
    return out


def describe(data: RunData) -> dict[str, Any]:
    """A JSON-able summary for the log: sources with sizes and routes, eval prompts per route."""
    return {
        "sources": {s.name: {"route": s.route, "size": len(s.dataset)} for s in data.dataset.sources},
        "eval": {route: len(p) for route, p in data.eval_prompts.items()},
    }
