"""Nothing silently ignored (issue 19): every config field, changed to another valid value, changes something
observable, or `--check` refuses it; the fields inert in some settings are the rows of `config/inert_fields.py`.

The fields are enumerated from the RunConfig type tree (a new field without a mutation here fails
`test_every_field_has_a_mutation`). Each mutation names the observable it must change, computed by the code
the job runs on the submit host or in its roles:

    plan      plan/placement.place_children (the children, GPUs, ports, rank env) and the actor's shape
    dry_run   `mopd-submit --dry-run` (warnings, rank map, memory plan, the sbatch command and script)
    warnings  the warnings `--check` prints (launch/prepare.py submit_warnings)
    data      trainer/data_setup.build_run_data: the first step's draws, the sources, the held-out prompts
    rollout   trainer/rollout_phase.step_rollouts (the controller's ROLLOUT): the /generate bodies sent
    timeline  trainer/intervals (the controller's metrics/checkpoint/evaluation/export steps)
    evaluation trainer/evaluator.RunEvaluator.point against engine stand-ins: its /generate bodies and values
    exports   trainer/exports.write_export at every export step: the exports left on disk after each step
    group     roles/actor_group.group_spec (the actor group's spec)
    teachers  roles/actor.teacher_pool for each teacher the actor scores (each replica client's name, timeout)
    rollout_clients roles/actor.rollout_clients for the rollout engines (each client's name, URL, timeout)
    loss      roles/actor.build_train_engine (torch, CPU, a micro Qwen3) and 3 train steps on a fixed batch
    refused   loading the config raises a ConfigError naming the mutated field

Each row of config/inert_fields.py is checked the other way: under its condition the mutation changes none of them.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import io
import json
import re
import typing
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from helpers_configs import uniform_mixture, without_sft_warmup
from helpers_models import save_micro_moe, save_micro_qwen3
from pydantic import BaseModel
from transformers import Qwen3Config

from mopd_hpc.config import ConfigError, RunConfig
from mopd_hpc.config.inert_fields import INERT, TOPK_NO_RATIO, inert_warnings
from mopd_hpc.config.schema import strip, tag_of, union_members

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


# ------------------------------------------------------------------------------------------ the fields
def field_paths(tp: Any = RunConfig, path: str = "") -> list[str]:
    """Every leaf field of the type tree: `a.b`, `[]` for a list item, `<tag>` for a union member."""
    tp = strip(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        out = []
        for name, info in tp.model_fields.items():
            out += field_paths(info.annotation, f"{path}.{name}" if path else name)
        return out
    if union_members(tp):
        return [p for m in union_members(tp) for p in field_paths(m, f"{path}<{tag_of(m)}>")]
    if typing.get_origin(tp) in (list, tuple):
        (item,) = typing.get_args(tp)[:1]
        inner = strip(item)
        if union_members(inner) or (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return field_paths(item, f"{path}[]")
    return [path]


FIELDS = field_paths()


# ------------------------------------------------------------------------------------------- documents
#: set_path's value that removes a key.
DELETE = object()


def set_path(doc: dict[str, Any], key: str, value: Any) -> None:
    """Set `a.b[1].c` in a nested YAML document; `value` DELETE removes the key."""
    parts: list[str | int] = []
    for part in key.split("."):
        name, *idx = re.split(r"\[(\d+)\]", part)
        parts += [name] if name else []
        parts += [int(i) for i in idx if i != ""]
    node: Any = doc
    for part in parts[:-1]:
        node = node[part]
    if value is DELETE:
        node.pop(parts[-1], None)
    else:
        node[parts[-1]] = copy.deepcopy(value)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("mutation")
    (root / "a.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(8))
    )
    (root / "b.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{i}*3=", "answer": str(3 * i)}) + "\n" for i in range(8))
    )
    for name, layers in (("big", 28), ("big2", 36)):  # config.json only: what the memory plan reads
        (root / name).mkdir()
        Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers).to_json_file(
            root / name / "config.json"
        )
    return SimpleNamespace(
        big=str(root / "big"),
        big2=str(root / "big2"),
        model=str(save_micro_qwen3(root / "model", seed=1)),
        other=str(save_micro_qwen3(root / "other", seed=2, vocab_size=64)),
        moe=str(save_micro_moe(root / "moe", seed=3)),  # router losses: a mixture-of-experts actor
        jsonl_a=str(root / "a.jsonl"),
        jsonl_b=str(root / "b.jsonl"),
        root=root,
    )


def _small(doc: dict[str, Any], files: SimpleNamespace) -> dict[str, Any]:
    doc.update(steps=4, checkpoint_interval=2, log_interval=1)
    doc["models"]["actor"]["path"] = files.model
    doc["models"]["tokenizer"] = {"path": files.model}
    for teacher in doc["models"]["teachers"]:
        teacher["path"] = files.model
    doc["data"].update(batch_size=4)
    doc["data"]["eval"]["size"] = 2
    return doc


def base_doc(name: str, files: SimpleNamespace) -> dict[str, Any]:
    """The documents the mutations start from: small copies of the shipped configs, paths to real files, MOPD from
    step 1 (configs/local_cpu.yaml's SFT warm-up off: its own rows mutate it), a uniform mixture (the weighted rows
    set their weights)."""
    source = {"cpu": "local_cpu", "het": "slurm_het_cpu", "gpu": "local_gpu_colocated_awex"}.get(
        name, "local_cpu"
    )
    doc = _small(
        uniform_mixture(without_sft_warmup(yaml.safe_load((CONFIGS / f"{source}.yaml").read_text()))), files
    )
    if name == "loss":  # the sampled estimator, its correction resolved (truncate), RL-ready groups of 2
        doc["loss"].update(estimator="sampled")
        doc["loss"].pop("correction", None)
        doc["data"]["samples_per_prompt"] = 2
    if name == "gpu":  # teachers of a size the memory plan shows (0.0 GiB for the micro model)
        doc["models"]["teachers"][0]["path"] = files.big
    if name == "jsonl":
        doc["data"]["sources"][1] = {"name": "mine", "kind": "jsonl", "path": files.jsonl_a, "route": "legs"}
    return doc


# ------------------------------------------------------------------------------------------- observers
def _plan(cfg: RunConfig) -> str:
    from mopd_hpc.config.parallel import ActorParallel
    from mopd_hpc.plan.placement import place_children

    return place_children(cfg).to_json() + repr(ActorParallel.from_config(cfg))


def _dry_run(cfg: RunConfig, tmp: Path) -> str:
    from mopd_hpc.cli.submit import add_arguments, execute

    path = tmp / "mutated.yaml"
    path.write_text(cfg.to_yaml())
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    rc = execute(
        parser.parse_args([str(path), "--dry-run"]), out=out, err=err, environ={}, python="/venv/bin/python"
    )
    return f"{rc}\n{out.getvalue()}\n{err.getvalue()}"


def _warnings(cfg: RunConfig) -> str:
    from mopd_hpc.launch.prepare import submit_warnings

    return "\n".join(submit_warnings(cfg))


def _memory(cfg: RunConfig) -> str:
    from mopd_hpc.launch.memory_check import memory_check

    return repr(memory_check(cfg, local_memory=lambda: None))


def _data(cfg: RunConfig) -> str:
    from mopd_hpc.trainer.data_setup import build_run_data

    data = build_run_data(cfg)
    draws = [(d.route, d.source, d.index, str(d.sample)) for d in data.dataset.take(cfg.data.batch_size)]
    sizes = {name: len(s) for name, s in data.sources.items()}
    held = {route: [str(p) for p in prompts] for route, prompts in data.eval_prompts.items()}
    return repr((draws, sizes, held))


class _Tokenizer:
    """Characters → ids (the rollout phase only encodes prompts and decodes responses)."""

    def __call__(self, texts: list[str] | str) -> dict[str, Any]:
        if isinstance(texts, str):
            return {"input_ids": [1 + ord(c) % 30 for c in texts]}
        return {"input_ids": [[1 + ord(c) % 30 for c in t] for t in texts]}

    eos_token_id = 2

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(48 + i % 10) for i in ids)


class _Client:
    """A rollout engine stand-in that records each /generate body and answers n two-token responses."""

    def __init__(self, name: str, bodies: list[Any]) -> None:
        self.base_url, self.bodies = name, bodies

    async def generate_raw(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        self.bodies.append((self.base_url, body))
        n = body["sampling_params"][0]["n"]
        meta = {"output_token_logprobs": [[-0.5, 3], [-0.7, 4]], "finish_reason": {"type": "stop"}}
        return [{"output_ids": [3, 4], "meta_info": meta} for _ in range(len(body["input_ids"]) * n)]

    async def generate_batch(self, body: dict[str, Any]) -> Any:
        from mopd_hpc.engines.rollout.generate_wire import GeneratedBatch

        return GeneratedBatch.from_sglang(await self.generate_raw(body))

    async def generate(
        self, input_ids: list[list[int]], sampling: Any, *, return_logprob: bool = True
    ) -> Any:
        """RolloutClient.generate's request (one sampling for every prompt) through `generate_raw`."""
        params = [sampling.to_json()] * len(input_ids)
        body = {"input_ids": [list(p) for p in input_ids], "sampling_params": params, "return_logprob": False}
        return (await self.generate_batch(body)).samples(input_ids, sampling.n)


def _greedy(teacher: str, bodies: list[Any]) -> Any:
    """A teacher server's greedy route stand-in that records each request and answers a digit and EOS."""

    async def generate(ids: Any, new: int, eos: int, pad: int) -> list[list[int]]:
        bodies.append((teacher, [list(i) for i in ids], new, eos, pad))
        return [[3, eos] for _ in ids]

    return generate


def _rollout(cfg: RunConfig) -> str:
    """The controller's ROLLOUT of step 1: the /generate bodies sent to the rollout engines or, in an SFT
    warm-up step (`loss.sft_warmup_steps`), the greedy requests sent to the teachers."""
    from mopd_hpc.plan.placement import place_children
    from mopd_hpc.trainer.data_setup import build_run_data
    from mopd_hpc.trainer.rollout_phase import step_rollouts
    from mopd_hpc.trainer.sft_warmup import is_sft_step, teacher_rollouts

    bodies: list[Any] = []
    engines = [c for c in place_children(cfg).children if c.role == "rollout"]
    clients = [_Client(f"engine{c.index}", bodies) for c in engines]
    greedy = {t: _greedy(t, bodies) for t in cfg.models.teacher_ids}
    try:
        if is_sft_step(1, cfg.loss, cfg.steps):
            asyncio.run(teacher_rollouts(cfg, build_run_data(cfg), greedy, _Tokenizer(), 0))
        else:
            asyncio.run(step_rollouts(cfg, build_run_data(cfg), clients, _Tokenizer(), 1, 0))
    except ValueError as exc:  # RolloutPhaseError: a prompt over data.max_prompt_tokens
        return f"error: {exc}"
    return json.dumps(bodies, sort_keys=True)


def _timeline(cfg: RunConfig) -> str:
    from mopd_hpc.trainer.intervals import checkpoint_due, eval_due, export_due, metrics_due

    due = (metrics_due, checkpoint_due, eval_due, export_due)
    return repr([(s, *(fn(s, cfg) for fn in due)) for s in range(1, cfg.steps + 1)])


def _evaluation(cfg: RunConfig) -> str:
    """The student's evaluation point (trainer/evaluator.py) against recording engine stand-ins: the
    /generate bodies it sends."""
    import tempfile

    from mopd_hpc.plan.placement import place_children
    from mopd_hpc.trainer.data_setup import build_run_data
    from mopd_hpc.trainer.evaluator import RunEvaluator

    bodies: list[Any] = []
    engines = [c for c in place_children(cfg).children if c.role == "rollout"]
    clients = [_Client(f"engine{c.index}", bodies) for c in engines]
    with tempfile.TemporaryDirectory() as tmp:
        evaluator = RunEvaluator(
            cfg, build_run_data(cfg), _Tokenizer(), clients, {}, Path(tmp), io.StringIO()
        )
        values = asyncio.run(evaluator.point(1))
    return json.dumps([bodies, values], sort_keys=True)


def _exports(cfg: RunConfig) -> str:
    """The exports left on disk after every step of the run (trainer/exports.py with a one-file engine)."""
    import tempfile

    from mopd_hpc.trainer.exports import list_exports, write_export
    from mopd_hpc.trainer.intervals import export_due

    class Engine:
        def save_pretrained(self, directory: Path) -> None:
            Path(directory).mkdir(parents=True)
            (Path(directory) / "tokenizer.json").write_text("{}")

    left = []
    with tempfile.TemporaryDirectory() as tmp:
        for step in range(1, cfg.steps + 1):
            if export_due(step, cfg):
                write_export(Engine(), None, tmp, step, cfg.export.keep)
            left.append([s for s, _ in list_exports(tmp)])
    return repr(left)


def _group(cfg: RunConfig) -> str:
    from mopd_hpc.config.parallel import ActorParallel
    from mopd_hpc.roles.actor_group import group_spec

    world = ActorParallel.from_config(cfg).world
    if world == 1:
        return "solo"
    role = SimpleNamespace(world_size=world, rank=0, device=SimpleNamespace(torch_name="cpu"))
    return repr(group_spec(role, cfg, {}, 60.0))


def _teachers(cfg: RunConfig) -> str:
    from mopd_hpc.mopd.plan import ExecutionPlan
    from mopd_hpc.roles.actor import teacher_pool

    plan = ExecutionPlan.from_config(cfg.loss, teachers=cfg.models.teacher_ids)
    pools = {t: teacher_pool(cfg, t, ["http://127.0.0.1:1"], None) for t in plan.teachers}
    return repr({t: [(c.name, c.timeout_s) for c in pool.clients] for t, pool in pools.items()})


def _rollout_clients(cfg: RunConfig) -> str:
    from mopd_hpc.roles.actor import rollout_clients

    urls = [f"http://127.0.0.1:{1 + i}" for i in range(cfg.rollout.engines.count)]
    return repr([(c.name, c.base_url, c.timeout.total) for c in rollout_clients(cfg, urls, None)])


def _loss(cfg: RunConfig) -> str:
    """3 train steps of the actor's torch engine as the role builds it, on one fixed batch carrying what
    every term reads (the teachers' top-k at k = loss.topk, as the teacher phase asks for it)."""
    from mopd_hpc.engines.batch import TokenBatch, TrainBatch
    from mopd_hpc.mopd.targets import TeacherTargets
    from mopd_hpc.mopd.topk import TeacherTopK
    from mopd_hpc.roles.actor import build_train_engine

    torch.manual_seed(0)
    engine = build_train_engine(cfg, "torch", SimpleNamespace(torch_name="cpu"))
    tokens = TokenBatch.from_rows([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5]], [2, 2], pad_id=0)
    bt = (2, tokens.response_width)
    gen = torch.Generator().manual_seed(3)
    mu = (-2.0 + 0.8 * torch.randn(bt, generator=gen)) * tokens.response_mask
    teacher_logits = 3.0 * torch.randn((*bt, 32), generator=gen)
    batch = TrainBatch.create(
        tokens,
        mu,
        targets=TeacherTargets(-1.0 + torch.randn(bt, generator=gen), torch.ones(bt)),
        teacher_topk={"t": TeacherTopK.from_logits(teacher_logits, cfg.loss.topk)},
        teacher_weights={"t": torch.ones(2)},
        orm_advantages=torch.tensor([1.0, -1.0]),
        ref_logprobs=(-2.5 + torch.randn(bt, generator=gen)) * tokens.response_mask,
    )
    keys = ("loss", "lr", "grad_norm", "grad_clip_coef", "micro_batches")
    steps = [engine.train_step(batch) for _ in range(3)]
    return repr([[round(float(s[k]), 6) for k in keys] for s in steps])


OBSERVERS: dict[str, Callable[..., str]] = {
    "plan": _plan,
    "dry_run": _dry_run,
    "warnings": _warnings,
    "memory": _memory,
    "data": _data,
    "rollout": _rollout,
    "timeline": _timeline,
    "evaluation": _evaluation,
    "exports": _exports,
    "group": _group,
    "teachers": _teachers,
    "rollout_clients": _rollout_clients,
    "loss": _loss,
}


_SEEN: dict[tuple[str, str], str] = {}


def observe(name: str, cfg: RunConfig, tmp: Path) -> str:
    """What observer `name` sees of `cfg` (memoized per resolved config: many mutations share a base)."""
    key = (name, cfg.to_yaml())
    if key not in _SEEN:
        fn = OBSERVERS[name]
        _SEEN[key] = fn(cfg, tmp) if name == "dry_run" else fn(cfg)
    return _SEEN[key]


# ------------------------------------------------------------------------------------------- mutations
SGLANG_GPU = {"rollout.backend": "sglang", "weight_sync.backend": "ipc", "weight_sync.awex_mode": None,
              "cluster.group.gpu_memory_gb": 80}  # fmt: skip
GPU2 = {"cluster.group.gpus_per_node": 2, "weight_sync.backend": "torch", "weight_sync.awex_mode": None}
GROUP_SCRIPT = ("cpus_per_task", 3), ("mem_gb", 16), ("partition", "p2"), ("account", "a2"), ("qos", "q2")
#: field (as `field_paths` writes it) → (base, setup, change, observer)
M = tuple[str, dict[str, Any], dict[str, Any], str]
MUTATIONS: dict[str, M] = {
    "name": ("cpu", {}, {"name": "other"}, "dry_run"),
    "run_dir": ("cpu", {}, {"run_dir": "runs/other"}, "dry_run"),
    "seed": ("cpu", {}, {"seed": 1}, "data"),
    "steps": ("cpu", {}, {"steps": 6}, "timeline"),
    "checkpoint_interval": ("cpu", {}, {"checkpoint_interval": 3}, "timeline"),
    "log_interval": ("cpu", {}, {"log_interval": 2}, "timeline"),
    "allow_unverified": ("cpu", {}, {"allow_unverified": True}, "warnings"),
    "models.actor.path": ("loss", {}, {"models.actor.path": "@other"}, "loss"),
    "models.actor.dtype": ("loss", {}, {"models.actor.dtype": "bfloat16"}, "loss"),
    "models.actor.engine": ("gpu", GPU2, {"models.actor.engine": "torch"}, "dry_run"),
    "models.actor.tensor_parallel": ("gpu", GPU2, {"models.actor.tensor_parallel": 2}, "plan"),
    "models.actor.pipeline_parallel": ("gpu", GPU2, {"models.actor.pipeline_parallel": 2}, "plan"),
    "models.actor.collective_timeout_s": (
        "het",
        {"cluster.trainer.actor_ranks_per_node": 2},
        {"models.actor.collective_timeout_s": 30.0},
        "group",
    ),
    "models.actor.optimizer.lr": ("loss", {}, {"models.actor.optimizer.lr": 1e-2}, "loss"),
    "models.actor.optimizer.schedule": ("loss", {}, {"models.actor.optimizer.schedule": "constant"}, "loss"),
    "models.actor.optimizer.warmup_ratio": ("loss", {}, {"models.actor.optimizer.warmup_ratio": 0.5}, "loss"),
    "models.actor.optimizer.min_lr_ratio": ("loss", {}, {"models.actor.optimizer.min_lr_ratio": 0.5}, "loss"),
    "models.actor.optimizer.weight_decay": ("loss", {}, {"models.actor.optimizer.weight_decay": 0.5}, "loss"),
    "models.actor.optimizer.grad_clip": ("loss", {}, {"models.actor.optimizer.grad_clip": 1e-3}, "loss"),
    "models.actor.micro_batch_tokens": ("loss", {}, {"models.actor.micro_batch_tokens": 8}, "loss"),
    "models.actor.activation_checkpointing": (
        "gpu",
        {"models.actor.path": "@big"},
        {"models.actor.activation_checkpointing": True},
        "dry_run",
    ),
    "models.teachers[].id": (
        "cpu",
        {},
        {"models.teachers[0].id": "chain2", "routes.chain": {"chain2": 1.0}},
        "plan",
    ),
    "models.teachers[].path": ("gpu", {}, {"models.teachers[0].path": "@big2"}, "dry_run"),
    "models.teachers[].engine": ("gpu", {}, {"models.teachers[0].engine": "torch"}, "dry_run"),
    "models.teachers[].dtype": ("gpu", {}, {"models.teachers[0].dtype": "float32"}, "dry_run"),
    "models.teachers[].tensor_parallel": ("gpu", GPU2, {"models.teachers[0].tensor_parallel": 2}, "plan"),
    "models.teachers[].replicas": ("cpu", {}, {"models.teachers[0].replicas": 2}, "plan"),
    "models.teachers[].residency": ("gpu", {}, {"models.teachers[0].residency": "never"}, "dry_run"),
    "models.teachers[].request_timeout_s": (
        "cpu",
        {},
        {"models.teachers[0].request_timeout_s": 30.0},
        "teachers",
    ),
    "models.tokenizer.path": ("cpu", {}, {"models.tokenizer.path": "@root/nothing"}, "warnings"),
    "routes": ("cpu", {}, {"routes.legs": {"chain": 1.0}}, "warnings"),
    "data.sources[]<reasoning_gym>.kind": (
        "cpu",
        {},
        {"data.sources[1]": {"name": "leg_counting", "kind": "jsonl", "path": "@jsonl_a", "route": "legs"}},
        "data",
    ),
    "data.sources[]<reasoning_gym>.name": ("cpu", {}, {"data.sources[0].name": "chain2"}, "data"),
    "data.sources[]<reasoning_gym>.route": (
        "cpu",
        {},
        {"data.sources[0].route": "legs", "data.sources[1].route": "chain"},
        "data",
    ),
    "data.sources[]<reasoning_gym>.weight": (
        "cpu",
        {"data.mixture": "weighted", "data.sources[0].weight": 1.0, "data.sources[1].weight": 1.0},
        {"data.sources[0].weight": 5.0},
        "data",
    ),
    "data.sources[]<reasoning_gym>.task": (
        "cpu",
        {},
        {"data.sources[0].task": "leg_counting", "data.sources[0].task_args": {}},
        "data",
    ),
    "data.sources[]<reasoning_gym>.task_args": (
        "cpu",
        {},
        {"data.sources[0].task_args": {"min_terms": 4, "max_terms": 5}},
        "data",
    ),
    "data.sources[]<jsonl>.kind": (
        "jsonl",
        {},
        {
            "data.sources[1]": {
                "name": "mine",
                "kind": "reasoning_gym",
                "task": "leg_counting",
                "route": "legs",
            }
        },
        "data",
    ),
    "data.sources[]<jsonl>.name": ("jsonl", {}, {"data.sources[1].name": "mine2"}, "data"),
    "data.sources[]<jsonl>.route": (
        "jsonl",
        {},
        {"data.sources[1].route": "chain", "data.sources[0].route": "legs"},
        "data",
    ),
    "data.sources[]<jsonl>.weight": (
        "jsonl",
        {"data.mixture": "weighted", "data.sources[0].weight": 1.0, "data.sources[1].weight": 1.0},
        {"data.sources[1].weight": 5.0},
        "data",
    ),
    "data.sources[]<jsonl>.path": ("jsonl", {}, {"data.sources[1].path": "@jsonl_b"}, "data"),
    # a source's template and reward ride on each of its prompts (data/scoring.py): the data observer sees them
    "data.sources[]<reasoning_gym>.template": ("cpu", {}, {"data.sources[0].template": "chat"}, "data"),
    "data.sources[]<reasoning_gym>.system_prompt": (
        "cpu",
        {"data.sources[0].template": "chat"},
        {"data.sources[0].system_prompt": "add"},
        "data",
    ),
    "data.sources[]<reasoning_gym>.chat_template_kwargs": (
        "cpu",
        {"data.sources[0].template": "chat"},
        {"data.sources[0].chat_template_kwargs": {"enable_thinking": False}},
        "data",
    ),
    "data.sources[]<reasoning_gym>.reward": ("cpu", {}, {"data.sources[0].reward": "math"}, "data"),
    "data.sources[]<reasoning_gym>.reward_pattern": (
        "cpu",
        {"data.sources[0].reward": "regex", "data.sources[0].reward_pattern": "\\d+"},
        {"data.sources[0].reward_pattern": "(\\d+)"},
        "data",
    ),
    "data.sources[]<jsonl>.template": ("jsonl", {}, {"data.sources[1].template": "chat"}, "data"),
    "data.sources[]<jsonl>.system_prompt": (
        "jsonl",
        {"data.sources[1].template": "chat"},
        {"data.sources[1].system_prompt": "add"},
        "data",
    ),
    "data.sources[]<jsonl>.chat_template_kwargs": (
        "jsonl",
        {"data.sources[1].template": "chat"},
        {"data.sources[1].chat_template_kwargs": {"enable_thinking": False}},
        "data",
    ),
    "data.sources[]<jsonl>.reward": ("jsonl", {}, {"data.sources[1].reward": "math"}, "data"),
    "data.sources[]<jsonl>.reward_pattern": (
        "jsonl",
        {"data.sources[1].reward": "regex", "data.sources[1].reward_pattern": "\\d+"},
        {"data.sources[1].reward_pattern": "(\\d+)"},
        "data",
    ),
    "data.mixture": ("cpu", {}, {"data.mixture": "proportional"}, "data"),
    "data.batch_size": ("cpu", {}, {"data.batch_size": 3}, "rollout"),
    "data.samples_per_prompt": ("cpu", {}, {"data.samples_per_prompt": 2}, "rollout"),
    "data.max_prompt_tokens": ("gpu", {}, {"data.max_prompt_tokens": 128}, "dry_run"),
    "data.eval.size": ("cpu", {}, {"data.eval.size": 3}, "data"),
    "data.eval.seed": ("cpu", {}, {"data.eval.seed": 20_000_000}, "data"),
    "data.eval.interval": ("cpu", {}, {"data.eval.interval": 3}, "timeline"),
    "data.eval.samples": ("cpu", {}, {"data.eval.samples": 2}, "evaluation"),
    "data.sources[]<jsonl>.eval_fraction": ("jsonl", {}, {"data.sources[1].eval_fraction": 0.25}, "data"),
    "data.sources[]<jsonl>.eval_path": ("jsonl", {}, {"data.sources[1].eval_path": "@jsonl_b"}, "data"),
    "export.interval": ("cpu", {"export": {}}, {"export.interval": 3}, "timeline"),
    "export.keep": ("cpu", {"export": {"interval": 1}}, {"export.keep": 3}, "exports"),
    "loss.estimator": ("loss", {}, {"loss.estimator": "topk"}, "loss"),
    "loss.topk": ("loss", {"loss.estimator": "topk"}, {"loss.topk": 4}, "loss"),
    "loss.correction": ("loss", {}, {"loss.correction": "mask"}, "loss"),
    "loss.ratio_cap": ("loss", {}, {"loss.ratio_cap": 0.9}, "loss"),
    "loss.mask_low": ("loss", {"loss.correction": "mask"}, {"loss.mask_low": 0.9}, "loss"),
    "loss.mask_high": ("loss", {"loss.correction": "mask"}, {"loss.mask_high": 1.1}, "loss"),
    "loss.advantage_clip": ("loss", {}, {"loss.advantage_clip": 0.01}, "loss"),
    "loss.normalizer": ("loss", {}, {"loss.normalizer": "seq-mean-token-mean"}, "loss"),
    "loss.distillation_coefficient": ("loss", {}, {"loss.distillation_coefficient": 0.5}, "loss"),
    "loss.rl_coefficient": ("loss", {}, {"loss.rl_coefficient": 0.5}, "loss"),
    "loss.router_aux_loss_coefficient": (
        "loss",
        {"models.actor.path": "@moe"},
        {"loss.router_aux_loss_coefficient": 0.5},
        "loss",
    ),
    "loss.router_z_loss_coefficient": (
        "loss",
        {"models.actor.path": "@moe"},
        {"loss.router_z_loss_coefficient": 0.1},
        "loss",
    ),
    "rollout.routing_replay": ("cpu", {}, {"rollout.routing_replay": True}, "rollout"),
    "models.actor.expert_parallel": ("cpu", {}, {"models.actor.expert_parallel": 2}, "warnings"),
    "loss.orm_alpha": ("loss", {}, {"loss.orm_alpha": 0.5}, "loss"),
    "loss.sft_warmup_steps": ("cpu", {}, {"loss.sft_warmup_steps": 1}, "rollout"),
    "loss.sft_warmup_ratio": ("cpu", {}, {"loss.sft_warmup_ratio": 1.0}, "rollout"),
    "loss.ppo_clip": ("loss", {"loss.rl_coefficient": 1.0}, {"loss.ppo_clip": 0.01}, "loss"),
    "loss.kl_coefficient": ("loss", {"loss.rl_coefficient": 1.0}, {"loss.kl_coefficient": 0.5}, "loss"),
    "rollout.backend": ("gpu", {}, {"rollout.backend": "sglang"}, "dry_run"),
    "rollout.sampling.temperature": ("cpu", {}, {"rollout.sampling.temperature": 0.7}, "rollout"),
    "rollout.sampling.top_p": ("cpu", {}, {"rollout.sampling.top_p": 0.9}, "rollout"),
    "rollout.sampling.max_new_tokens": ("cpu", {}, {"rollout.sampling.max_new_tokens": 7}, "rollout"),
    "rollout.engines.count": ("het", {}, {"rollout.engines.count": 1}, "plan"),
    "rollout.engines.tensor_parallel": ("gpu", GPU2, {"rollout.engines.tensor_parallel": 2}, "plan"),
    "rollout.mode": ("cpu", {}, {"rollout.mode": "separated"}, "plan"),
    "rollout.forked": ("het", {}, {"rollout.forked": False}, "refused"),
    "rollout.request_timeout_s": ("cpu", {}, {"rollout.request_timeout_s": 30.0}, "rollout_clients"),
    # eager decoding frees the KV cache after each batch: the plan holds it in the rollout phase only
    "rollout.compile_decode": ("gpu", {}, {"rollout.compile_decode": False}, "dry_run"),
    "rollout.graph_rows": ("gpu", {}, {"rollout.graph_rows": 1}, "dry_run"),
    # SGLang's static share: the memory plan's KV pool of the engine (shown with the GPU's memory known)
    "rollout.mem_fraction_static": ("gpu", SGLANG_GPU, {"rollout.mem_fraction_static": 0.3}, "dry_run"),
    "weight_sync.backend": (
        "gpu",
        {},
        {"weight_sync.backend": "torch", "weight_sync.awex_mode": None},
        "plan",
    ),
    "cluster.backend": ("cpu", {}, {"cluster.backend": "slurm"}, "dry_run"),
    "cluster.shape": (
        "het",
        {},
        {
            "cluster.shape": "colocated",
            "cluster.group": {"nodes": 1, "gpus_per_node": 0, "cpus_per_task": 2},
            "cluster.trainer": DELETE,
            "cluster.rollout": DELETE,
        },
        "plan",
    ),
    "cluster.time_min": ("cpu", {}, {"cluster.time_min": 30}, "dry_run"),
    "cluster.signal": ("cpu", {}, {"cluster.signal": "B:USR1@90"}, "dry_run"),
    "cluster.requeue": ("cpu", {}, {"cluster.requeue": False}, "dry_run"),
    "cluster.max_requeues": ("cpu", {}, {"cluster.max_requeues": 1}, "dry_run"),
    "cluster.extra_sbatch": ("cpu", {}, {"cluster.extra_sbatch": ["--constraint=h200"]}, "dry_run"),
}
#: the het base with the teachers in their own het group `teacher` (CPU)
TEACHER_GROUP = {
    "cluster.teacher_placement": "own_group",
    "cluster.teacher": {"nodes": 1, "cpus_per_task": 1},
}
MUTATIONS["cluster.teacher_placement"] = ("het", {}, TEACHER_GROUP, "plan")
for _group_name, _base, _setup in (
    ("trainer", "het", {}), ("teacher", "het", TEACHER_GROUP), ("rollout", "het", {}), ("group", "cpu", {}),
):  # fmt: skip
    _g = f"cluster.{_group_name}"
    for _field, _value in GROUP_SCRIPT:
        MUTATIONS[f"{_g}.{_field}"] = (_base, _setup, {f"{_g}.{_field}": _value}, "dry_run")
    MUTATIONS[f"{_g}.nodes"] = (_base, _setup, {f"{_g}.nodes": 3}, "plan")
    MUTATIONS[f"{_g}.gpus_per_node"] = (
        _base,
        {**_setup, "cluster.backend": "slurm"},
        {f"{_g}.gpus_per_node": 1, "weight_sync.backend": "torch"},
        "plan",
    )
    for _field, _value in (("gpu_memory_gb", 1e-4), ("gpu_type", "A100-40GB")):
        MUTATIONS[f"{_g}.{_field}"] = (
            _base,
            {**_setup, "cluster.backend": "slurm", f"{_g}.gpus_per_node": 1, "models.actor.path": "@big",
             "models.teachers[0].path": "@big"},
            {f"{_g}.{_field}": _value},
            "memory",
        )  # fmt: skip
    MUTATIONS[f"{_g}.actor_ranks_per_node"] = (
        _base,
        {**_setup, f"{_g}.cpus_per_task": 2},
        {f"{_g}.actor_ranks_per_node": 2},
        "refused" if _group_name in ("rollout", "teacher") else "plan",
    )
# the teachers' own GPUs of the actor's group: one more moves an actor rank's GPU to the teachers
_OWN_GPUS = {
    "cluster.teacher_placement": "own_gpus",
    "weight_sync.backend": "torch",
    "weight_sync.awex_mode": None,
}
MUTATIONS["cluster.trainer.teacher_gpus_per_node"] = (
    "het",
    {**_OWN_GPUS, "cluster.backend": "slurm", "cluster.trainer.gpus_per_node": 3,
     "cluster.trainer.teacher_gpus_per_node": 1},
    {"cluster.trainer.teacher_gpus_per_node": 2},
    "plan",
)  # fmt: skip
MUTATIONS["cluster.group.teacher_gpus_per_node"] = (
    "gpu",
    {**_OWN_GPUS, "cluster.group.gpus_per_node": 3, "cluster.group.teacher_gpus_per_node": 1},
    {"cluster.group.teacher_gpus_per_node": 2},
    "plan",
)
for _group_name, _setup in (("rollout", {}), ("teacher", TEACHER_GROUP)):  # only the actor's group gives GPUs
    MUTATIONS[f"cluster.{_group_name}.teacher_gpus_per_node"] = (
        "het",
        {
            **_setup,
            "cluster.backend": "slurm",
            f"cluster.{_group_name}.gpus_per_node": 2,
            "weight_sync.backend": "torch",
        },  # fmt: skip
        {f"cluster.{_group_name}.teacher_gpus_per_node": 1},
        "refused",
    )


#: inert row (field, condition) → (base, setup, change): a config where the condition holds, and a mutation.
C_D0 = {"loss.distillation_coefficient": 0.0, "loss.rl_coefficient": 1.0, "data.samples_per_prompt": 2}
WITNESSES: dict[tuple[str, str], tuple[str, dict[str, Any], dict[str, Any]]] = {
    ("models.actor.id", "always"): ("cpu", {}, {"models.actor.id": "pupil"}),
    ("models.actor.collective_timeout_s", "the actor's world is 1 rank"): (
        "cpu",
        {},
        {"models.actor.collective_timeout_s": 30.0},
    ),
    ("weight_sync.awex_mode", "always"): ("gpu", {}, {"weight_sync.awex_mode": None}),
    ("rollout.compile_decode", "the rollout group has no GPUs"): (
        "cpu",
        {},
        {"rollout.compile_decode": False},
    ),
    ("models.teachers[].id", "loss.distillation_coefficient is 0"): (
        "loss",
        C_D0,
        {"models.teachers[0].id": "chain2", "routes.chain": {"chain2": 1.0}},
    ),
    ("models.teachers[].path", "loss.distillation_coefficient is 0"): (
        "gpu",
        C_D0,
        {"models.teachers[0].path": "@big2"},
    ),
    ("models.teachers[].engine", "loss.distillation_coefficient is 0"): (
        "gpu",
        C_D0,
        {"models.teachers[0].engine": "torch"},
    ),
    ("models.teachers[].dtype", "loss.distillation_coefficient is 0"): (
        "gpu",
        C_D0,
        {"models.teachers[0].dtype": "float32"},
    ),
    ("models.teachers[].replicas", "loss.distillation_coefficient is 0"): (
        "cpu",
        C_D0,
        {"models.teachers[0].replicas": 2},
    ),
    ("models.teachers[].request_timeout_s", "loss.distillation_coefficient is 0"): (
        "cpu",
        C_D0,
        {"models.teachers[0].request_timeout_s": 30.0},
    ),
    ("models.teachers[].residency", "loss.distillation_coefficient is 0"): (
        "gpu",
        C_D0,
        {"models.teachers[0].residency": "never"},
    ),
    ("models.teachers[].residency", "the teachers' group has no GPUs"): (
        "cpu",
        {},
        {"models.teachers[0].residency": "never"},
    ),
    ("routes", "loss.distillation_coefficient is 0"): ("loss", C_D0, {"routes.chain": {"chain": 2.0}}),
    ("loss.topk", "loss.estimator is 'sampled'"): ("loss", {}, {"loss.topk": 4}),
    ("cluster.max_requeues", "cluster.requeue is false"): (
        "cpu",
        {"cluster.requeue": False},
        {"cluster.max_requeues": 1},
    ),
    **{
        (f"loss.{name}", "loss.distillation_coefficient is 0"): (
            "loss",
            {**C_D0, **setup},
            {f"loss.{name}": value},
        )
        for name, setup, value in (
            ("estimator", {}, "topk"),
            ("topk", {"loss.estimator": "topk"}, 4),
            ("correction", {}, "mask"),
            ("ratio_cap", {}, 0.9),
            ("mask_low", {"loss.correction": "mask"}, 0.9),
            ("mask_high", {"loss.correction": "mask"}, 1.1),
            ("advantage_clip", {}, 0.01),
            ("orm_alpha", {}, 0.5),
        )
    },
    ("loss.ratio_cap", "loss.estimator is 'topk'"): (
        "loss",
        {"loss.estimator": "topk"},
        {"loss.ratio_cap": 0.9},
    ),
    ("loss.mask_low", "loss.estimator is 'topk'"): (
        "loss",
        {"loss.estimator": "topk"},
        {"loss.mask_low": 0.9},
    ),
    ("loss.mask_high", "loss.estimator is 'topk'"): (
        "loss",
        {"loss.estimator": "topk"},
        {"loss.mask_high": 1.1},
    ),
    ("loss.advantage_clip", "loss.estimator is 'topk'"): (
        "loss",
        {"loss.estimator": "topk"},
        {"loss.advantage_clip": 0.01},
    ),
    ("loss.ratio_cap", "loss.correction is not 'truncate'"): (
        "loss",
        {"loss.correction": "none"},
        {"loss.ratio_cap": 0.9},
    ),
    ("loss.mask_low", "loss.correction is not 'mask'"): ("loss", {}, {"loss.mask_low": 0.9}),
    ("loss.mask_high", "loss.correction is not 'mask'"): ("loss", {}, {"loss.mask_high": 1.1}),
    ("loss.ppo_clip", "loss.rl_coefficient is 0"): ("loss", {}, {"loss.ppo_clip": 0.01}),
    ("data.eval.seed", "data.eval.size is 0 and no source has an eval_fraction"): (
        "cpu",
        {"data.eval.size": 0},
        {"data.eval.seed": 20_000_000},
    ),
    ("data.eval.interval", "data.eval.size is 0"): ("cpu", {"data.eval.size": 0}, {"data.eval.interval": 2}),
    ("data.eval.samples", "data.eval.size is 0"): ("cpu", {"data.eval.size": 0}, {"data.eval.samples": 2}),
    ("export.keep", "export.interval is 0"): ("cpu", {"export": {}}, {"export.keep": 1}),
    ("cluster.*.gpu_memory_gb", "the group's gpus_per_node is 0"): (
        "cpu",
        {},
        {"cluster.group.gpu_memory_gb": 1e-4},
    ),
    ("cluster.*.gpu_type", "the group's gpus_per_node is 0"): (
        "cpu",
        {},
        {"cluster.group.gpu_type": "H100-80GB"},
    ),
}


def build(files: SimpleNamespace, base: str, *changes: dict[str, Any]) -> dict[str, Any]:
    doc = base_doc(base, files)
    for change in changes:
        for key, value in change.items():
            if isinstance(value, str) and value.startswith("@"):
                head, _, tail = value[1:].partition("/")
                value = str(Path(getattr(files, head)) / tail) if tail else getattr(files, head)
            elif isinstance(value, dict):
                value = {
                    k: (getattr(files, v[1:]) if isinstance(v, str) and v.startswith("@") else v)
                    for k, v in value.items()
                }
            set_path(doc, key, value)
    return doc


def concrete(field: str) -> str:
    """`models.teachers[].path` → `models.teachers[0].path`, `data.sources[]<jsonl>.path` → `...[1].path`."""
    index = "1" if "<jsonl>" in field else "0"
    return re.sub(r"<[a-z_]+>", "", field.replace("[]", f"[{index}]"))


# ----------------------------------------------------------------------------------------------- tests
def test_every_field_has_a_mutation() -> None:
    always_inert = {row.field for row in INERT if row.condition == "always"}
    missing = [f for f in FIELDS if f not in MUTATIONS and f not in always_inert]
    assert not missing, f"fields with no mutation in tests/config/test_config_mutation.py: {missing}"
    assert not set(MUTATIONS) - set(FIELDS), "mutations of fields that do not exist"
    assert len(FIELDS) >= 100


def test_inert_rows_name_fields_that_exist_and_have_a_witness() -> None:
    for row in INERT:
        assert any(row.matches(f) for f in FIELDS), f"config/inert_fields.py names no field: {row.field}"
        assert (row.field, row.condition) in WITNESSES, (
            f"no witness for inert row {row.field} / {row.condition}"
        )
    assert set(WITNESSES) == {(r.field, r.condition) for r in INERT}
    # with topk the correction is refused, not inert (test_topk_refuses_a_correction); its knobs are inert
    topk = {r.field for r in INERT if r.condition == "loss.estimator is 'topk'"}
    assert topk == {"loss.ratio_cap", "loss.mask_low", "loss.mask_high", "loss.advantage_clip"}
    assert {r.field for r in INERT if r.reason == TOPK_NO_RATIO} == topk - {"loss.advantage_clip"}


@pytest.mark.parametrize("correction", ["truncate", "mask"])
def test_topk_refuses_a_correction(correction: str, files: SimpleNamespace) -> None:
    """estimator topk with correction truncate or mask: --check refuses it naming loss.correction (the
    per-position reverse KL has no per-token ratio); unset, the correction resolves to 'none' there."""
    with pytest.raises(ConfigError) as info:
        RunConfig.from_dict(build(files, "loss", {"loss.estimator": "topk", "loss.correction": correction}))
    (problem,) = [p for p in info.value.problems if p.path == "loss.correction"]
    assert problem.got == correction and "correction: none" in problem.expected, problem.render()
    assert RunConfig.from_dict(build(files, "loss", {"loss.estimator": "topk"})).loss.correction == "none"
    assert RunConfig.from_dict(build(files, "loss", {})).loss.correction == "truncate"


@pytest.mark.parametrize("field", sorted(MUTATIONS))
def test_mutation_is_observable(field: str, files: SimpleNamespace, tmp_path: Path) -> None:
    base, setup, change, observer = MUTATIONS[field]
    before = RunConfig.from_dict(build(files, base, setup))
    if observer == "refused":
        with pytest.raises(ConfigError) as info:
            RunConfig.from_dict(build(files, base, setup, change))
        assert concrete(field) in [p.path for p in info.value.problems], str(info.value)
        return
    after = RunConfig.from_dict(build(files, base, setup, change))
    assert before != after
    assert observe(observer, before, tmp_path) != observe(observer, after, tmp_path), (
        f"{field}: {change} changed nothing the {observer} observer sees"
    )


@pytest.mark.parametrize("key", sorted(WITNESSES), ids=lambda k: f"{k[0]}|{k[1]}")
def test_inert_row_is_inert(key: tuple[str, str], files: SimpleNamespace, tmp_path: Path) -> None:
    (row,) = [r for r in INERT if (r.field, r.condition) == key]
    base, setup, change = WITNESSES[key]
    before = RunConfig.from_dict(build(files, base, setup))
    after = RunConfig.from_dict(build(files, base, setup, change))
    assert row.when(before) and row.when(after), f"the witness of {key} does not meet its condition"
    norm = [re.sub(r"\[\d+\]", "[]", k) for k in change]
    assert any(row.matches(k) or k.startswith(f"{row.field}.") for k in norm), (
        f"{key}: the witness changes {norm}"
    )
    for name in OBSERVERS:  # --check's warning that the field has no effect aside
        seen = [_without_inert_warnings(observe(name, cfg, tmp_path)) for cfg in (before, after)]
        assert seen[0] == seen[1], f"{key}: {name} changed"
    # --check warns of a field set where it has no effect, and of nothing else the mutation did not touch
    new = {p.path for p in inert_warnings(after)} - {p.path for p in inert_warnings(before)}
    assert new <= set(change), (key, new)


def _without_inert_warnings(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if ": has no effect when " not in line)


def test_check_warns_of_a_field_set_where_it_has_no_effect() -> None:
    from mopd_hpc.config import load_run_config

    cfg = load_run_config(CONFIGS / "local_cpu.yaml", ["loss.estimator=sampled", "loss.topk=8"], False)
    assert [p.render() for p in inert_warnings(cfg)] == [
        "loss.topk: has no effect when loss.estimator is 'sampled': the sampled estimator asks the teachers for "
        "token log-probs, no top-k (trainer/rank_step.py) (got 8; remove it; it takes effect once "
        "loss.estimator is 'sampled' no longer holds)"
    ]
    for path in CONFIGS.glob("*.yaml"):  # the shipped configs set nothing that has no effect
        assert inert_warnings(load_run_config(path, [], False)) == [], path
