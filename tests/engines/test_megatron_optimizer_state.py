"""The megatron actor's checkpoint carries the distributed optimizer's parameter state (CPU part).

megatron's DistributedOptimizer needs CUDA, so the optimizer here is a stand-in with its API and its
semantics: a bf16 model, fp32 main params stepped by a real torch Adam (megatron's fallback without
Transformer Engine), `state_dict` = the DP-independent part (param groups with lr and step),
`load_state_dict` allocating the moments as megatron's does (empty tensors plus ONE tensor "step" shared
by every parameter, which torch Adam keeps shared: `optimizer_state.separate_steps`),
`get_parameter_state_dp_zero` / `load_parameter_state_from_dp_zero` with megatron's dict layout and its
copy of every tensor of a parameter's optimizer state (`_set_main_param_and_optimizer_states`: a KeyError
on "step" unless it is hidden). Over a real gloo group of 2 processes the stand-in shards as ZeRO-1 does
(each DP rank steps the main params it owns, then broadcasts them; the dp_zero dict is gathered to and
scattered from DP rank 0 with gloo). The engine is `MegatronTrainEngine` itself (its
state_dict/load_state_dict), built without its CUDA constructor; checkpoints go through `save_checkpoint` /
`load_latest` (the follower's `load_checkpoint(verify_own_files=False)` on DP rank 1).

Oracle: 3 steps straight equal 2 steps, save, a fresh engine (other initial weights) loads, 1 step: the
weights, exp_avg and exp_avg_sq bitwise, the step count and lr equal (the lr of megatron-core's scheduler,
a cosine decay over the 3 steps, restored from the checkpoint), at DP 1 and DP 2. The parameter state
is its own file (optimizer_param_state.pt, in the manifest, not in model.pt), read memory-mapped by DP rank 0
alone: DP rank 1 never opens it (an audit hook records every `open` of the file in each process). A byte
flipped or cut in it, or the file removed, is refused by the checkpoint verification and the previous good
checkpoint loaded. A checkpoint of the older layout (the state inside model.pt, no "files" in state.json)
resumes bitwise as before. Without the parameter state the resumed weights differ (the check can fail).
"""

from __future__ import annotations

import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import helpers_fork
import pytest
import torch
import torch.distributed as dist
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from mopd_hpc.config.models import OptimizerConfig
from mopd_hpc.engines.data_parallel import DataParallel
from mopd_hpc.engines.lr_schedule import megatron_scheduler_args
from mopd_hpc.engines.megatron import engine as megatron_engine
from mopd_hpc.engines.megatron import optimizer_state
from mopd_hpc.engines.own_file import FileRef, OwnFile
from mopd_hpc.engines.protocol import EngineError
from mopd_hpc.trainer import checkpoint_verify
from mopd_hpc.trainer.checkpoint import CheckpointError, load_checkpoint, load_latest, save_checkpoint

DTYPE_KEY = (torch.bfloat16, torch.float32)  # megatron's (param dtype, grad dtype) key
#: The stand-in's lr schedule (the stand-in Adam's lr 1e-2 is its peak).
SCHEDULE = OptimizerConfig(lr=1e-2, schedule="cosine", min_lr_ratio=0.1)


class StandInDistOpt:
    """megatron's DistributedOptimizer over one grad buffer (module docstring): one fp32 main param per model
    param, the dp_zero dict holds them (and their moments) concatenated. Over a gloo `group` of n ranks, rank
    r owns (steps, keeps moments of) the params i with i % n == r, as ZeRO-1 owns a range of the buffer."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-2, group: Any = None) -> None:
        self.model, self.group = model, group
        self.rank, self.size = (group.rank(), group.size()) if group is not None else (0, 1)
        self.mains = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
        self.owned = [i for i in range(len(self.mains)) if i % self.size == self.rank]
        self.optimizer = torch.optim.Adam([self.mains[i] for i in self.owned], lr=lr)
        self.buffers = [SimpleNamespace(numel_unpadded=sum(m.numel() for m in self.mains))]
        self.data_parallel_group = (
            group if group is not None else SimpleNamespace(rank=lambda: 0, size=lambda: 1)
        )

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # as megatron's: the inner optimizer's, also after a load
        return self.optimizer.param_groups

    def step(self) -> None:
        for i in self.owned:  # every rank sees the same gradient (the same rows: DP's all-reduced one)
            self.mains[i].grad = list(self.model.parameters())[i].grad.float()
        self.optimizer.step()
        with torch.no_grad():
            for i, (main, p) in enumerate(zip(self.mains, self.model.parameters(), strict=True)):
                if (
                    self.size > 1
                ):  # the owner's updated main param to every rank (megatron's param all-gather)
                    dist.broadcast(main.data, group=self.group, group_src=i % self.size)
                p.copy_(main)

    def state_dict(self) -> dict[str, Any]:
        inner = self.optimizer.state_dict()
        steps = {s["step"].item() for s in inner["state"].values()}
        assert len(steps) == 1
        step = steps.pop()
        groups = [
            {k: v for k, v in g.items() if k != "params"} | {"step": step} for g in inner["param_groups"]
        ]
        return {"optimizer": {"param_groups": groups}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """megatron's no-TE path: empty moments and ONE step tensor given to every param."""
        groups = [dict(g, params=list(range(len(self.owned)))) for g in state["optimizer"]["param_groups"]]
        step = torch.tensor(groups[0].pop("step"), dtype=torch.float)
        garbage = float("nan")  # megatron allocates with torch.empty: whatever the memory held
        owned = [self.mains[i] for i in self.owned]
        inner = {j: {"exp_avg": torch.full_like(m, garbage), "exp_avg_sq": torch.full_like(m, garbage),
                     "step": step} for j, m in enumerate(owned)}  # fmt: skip
        self.optimizer.load_state_dict({"state": inner, "param_groups": groups})

    def reload_model_params(self) -> None:
        with torch.no_grad():
            for main, p in zip(self.mains, self.model.parameters(), strict=True):
                main.copy_(p)

    def _owned_tensors(self, i: int) -> dict[str, torch.Tensor]:
        main = self.mains[i]
        return {
            "param": main.detach(),
            **{k: self.optimizer.state[main][k] for k in ("exp_avg", "exp_avg_sq")},
        }

    def _flat(self, key: str) -> torch.Tensor:
        """This rank's owned params' `key`, concatenated (every param at DP 1)."""
        if key == "param":
            return torch.cat([self.mains[i].detach().reshape(-1) for i in self.owned])
        return torch.cat([self._owned_tensors(i)[key].reshape(-1) for i in self.owned])

    def get_parameter_state_dp_zero(self) -> dict[Any, Any] | None:
        mine = {i: {k: t.clone() for k, t in self._owned_tensors(i).items()} for i in self.owned}
        gathered = [mine]
        if self.size > 1:
            gathered = [None] * self.size if self.rank == 0 else None
            dist.gather_object(mine, gathered, group=self.group, group_dst=0)
        if self.rank != 0:
            return None  # megatron's: the state on DP rank 0 only
        pieces = {i: t for g in gathered for i, t in g.items()}
        part: dict[str, Any] = {
            k: torch.cat([pieces[i][k].reshape(-1) for i in range(len(self.mains))])
            for k in ("param", "exp_avg", "exp_avg_sq")
        }
        part["numel_unpadded"] = self.buffers[0].numel_unpadded
        return {"buckets_coalesced": True, 0: {DTYPE_KEY: part}}

    def load_parameter_state_from_dp_zero(self, state: dict[Any, Any] | None) -> None:
        def pieces_of(rank: int) -> dict[int, dict[str, torch.Tensor]]:
            out, offset = {}, 0
            for i, main in enumerate(self.mains):
                n = main.numel()
                if i % self.size == rank:
                    out[i] = {
                        k: state[0][DTYPE_KEY][k][offset : offset + n].view_as(main)
                        for k in ("param", "exp_avg", "exp_avg_sq")
                    }
                offset += n
            return out

        if self.size == 1:
            mine = pieces_of(0)
        else:  # DP rank 0 sends each rank its shard (megatron: a gloo scatter of each bucket)
            received: list[Any] = [None]
            send = [pieces_of(r) for r in range(self.size)] if self.rank == 0 else None
            dist.scatter_object_list(received, send, group=self.group, group_src=0)
            mine = received[0]
        for i in self.owned:
            main = self.mains[i]
            dst = {"param": main, **self.optimizer.state[main]}  # megatron-core 0.16.1's copy
            with torch.no_grad():
                for key in dst:
                    dst[key].copy_(mine[i][key])


def _engine(seed: int, group: Any = None) -> megatron_engine.MegatronTrainEngine:
    torch.manual_seed(seed)
    model = torch.nn.Linear(6, 4).to(torch.bfloat16)
    engine = object.__new__(megatron_engine.MegatronTrainEngine)
    engine.model, engine.steps = model, 0
    engine.optimizer = StandInDistOpt(model, group=group)
    engine.shard_plan, engine.tp_rank = SimpleNamespace(tp=1), 0
    engine.residency = SimpleNamespace(on_device=True)
    # megatron-core's own lr scheduler, as the engine builds it: a cosine decay over the 3 steps of the tests,
    # so that a resume that lost the schedule's place trains step 3 at another lr
    engine.scheduler = OptimizerParamScheduler(engine.optimizer, **megatron_scheduler_args(SCHEDULE, 3))
    engine.data_parallel = (
        DataParallel(group.rank(), group.size(), group) if group is not None else DataParallel.single()
    )
    return engine


def _step(engine: megatron_engine.MegatronTrainEngine, k: int) -> None:
    g = torch.Generator().manual_seed(100 + k)
    x, y = torch.randn(5, 6, generator=g).bfloat16(), torch.randn(5, 4, generator=g)
    engine.model.zero_grad()
    ((engine.model(x).float() - y) ** 2).mean().backward()  # the gradient depends on the weights
    engine.optimizer.step()
    engine.scheduler.step(1)  # as MegatronTrainEngine.train_step
    engine.steps += 1


def _moments(engine: megatron_engine.MegatronTrainEngine) -> dict[str, torch.Tensor]:
    """This rank's owned fp32 main params, exp_avg, exp_avg_sq and step tensors."""
    opt = engine.optimizer
    steps = torch.stack([opt.optimizer.state[opt.mains[i]]["step"] for i in opt.owned])
    return {k: opt._flat(k) for k in ("param", "exp_avg", "exp_avg_sq")} | {"steps": steps}


def _resumed(
    root: Path, drop_param_state: bool = False, old_layout: bool = False
) -> megatron_engine.MegatronTrainEngine:
    saved = _engine(0)
    for k in (1, 2):
        _step(saved, k)
    state = saved.state_dict()
    if drop_param_state:
        state[optimizer_state.PARAM_STATE_KEY] = state[optimizer_state.PARAM_LAYOUT_KEY] = None
    if old_layout:
        _save_old_layout(root, 2, state)
    else:
        save_checkpoint(root, 2, state, rng_state={})
    fresh = _engine(7)  # other initial weights: everything must come from the checkpoint
    fresh.load_state_dict(load_latest(root).engine_state)
    return fresh


def _save_old_layout(root: Path, step: int, state: dict[str, Any]) -> Path:
    """What the checkpoint held before the parameter state had its own file: the state itself in model.pt,
    no layout key, no "files" in state.json (the manifest written for that)."""
    old = {k: v for k, v in state.items() if k != optimizer_state.PARAM_LAYOUT_KEY}
    old[optimizer_state.PARAM_STATE_KEY] = old[optimizer_state.PARAM_STATE_KEY].value
    path = save_checkpoint(root, step, old, rng_state={})
    body = json.loads((path / "state.json").read_text())
    assert body.pop("files") == {}
    (path / "state.json").write_text(json.dumps(body))
    (path / checkpoint_verify.MANIFEST).write_text(json.dumps(checkpoint_verify.manifest_for(path)))
    return path


def _assert_resume_equals_straight_run(resumed: megatron_engine.MegatronTrainEngine) -> None:
    straight = _engine(0)
    for k in (1, 2):
        _step(straight, k)
    for k, v in _moments(straight).items():
        assert torch.equal(_moments(resumed)[k], v), k  # exp_avg, exp_avg_sq, fp32 main params after step 2
    assert resumed.steps == 2
    assert resumed.optimizer.state_dict() == straight.optimizer.state_dict()  # step count and lr
    _step(straight, 3)
    _step(resumed, 3)
    for (name, a), b in zip(
        straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    assert all(
        torch.equal(a, b)
        for a, b in zip(_moments(straight).values(), _moments(resumed).values(), strict=True)
    )


def test_resume_equals_straight_run_bitwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[tuple[str, bool]] = []
    real_load = torch.load

    def recording_load(f: Any, *args: Any, **kwargs: Any) -> Any:
        loads.append((Path(f).name, bool(kwargs.get("mmap"))))
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    _assert_resume_equals_straight_run(_resumed(tmp_path / "ck"))
    step_dir = tmp_path / "ck" / "step_000002"
    assert (optimizer_state.PARAM_STATE_FILE, True) in loads  # read memory-mapped
    assert ("model.pt", False) in loads
    # its own file, listed in the manifest (size, SHA-256) and in state.json; model.pt holds the layout only
    manifest = json.loads((step_dir / checkpoint_verify.MANIFEST).read_text())["files"]
    own = step_dir / optimizer_state.PARAM_STATE_FILE
    assert manifest[own.name] == {"bytes": own.stat().st_size, "sha256": checkpoint_verify.sha256_of(own)}
    assert json.loads((step_dir / "state.json").read_text())["files"] == {
        optimizer_state.PARAM_STATE_KEY: optimizer_state.PARAM_STATE_FILE
    }
    in_model = real_load(step_dir / "model.pt", weights_only=True)
    assert optimizer_state.PARAM_STATE_KEY not in in_model
    assert in_model[optimizer_state.PARAM_LAYOUT_KEY] == [
        {0: {DTYPE_KEY: dict.fromkeys(optimizer_state.TENSOR_KEYS, 28)}}
    ]
    assert isinstance(load_latest(tmp_path / "ck").engine_state[optimizer_state.PARAM_STATE_KEY], FileRef)


def test_an_old_layout_checkpoint_still_resumes_bitwise(tmp_path: Path) -> None:
    resumed = _resumed(tmp_path / "ck", old_layout=True)  # the state inside model.pt, every rank loads it
    assert not (tmp_path / "ck" / "step_000002" / optimizer_state.PARAM_STATE_FILE).exists()
    _assert_resume_equals_straight_run(resumed)


def test_without_the_parameter_state_the_resume_differs(tmp_path: Path) -> None:
    straight = _engine(0)
    for k in (1, 2, 3):
        _step(straight, k)
    resumed = _resumed(tmp_path / "ck", drop_param_state=True)
    assert not (tmp_path / "ck" / "step_000002" / optimizer_state.PARAM_STATE_FILE).exists()
    moments = _moments(resumed)
    assert not moments["exp_avg"].any() and not moments["exp_avg_sq"].any()  # restarted at 0, not garbage
    _step(resumed, 3)
    assert torch.isfinite(resumed.model.weight).all()
    assert not torch.equal(straight.model.weight, resumed.model.weight)


def test_megatron_copy_needs_the_step_hidden() -> None:
    engine = _engine(0)
    _step(engine, 1)
    state = engine.optimizer.get_parameter_state_dp_zero()
    with pytest.raises(KeyError, match="step"):  # what megatron's own load does with torch Adam's state
        engine.optimizer.load_parameter_state_from_dp_zero(state)
    optimizer_state.scatter(engine.optimizer, [state])
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in engine.optimizer.optimizer.state.values())


def test_a_state_that_does_not_fit_is_refused_before_loading(tmp_path: Path) -> None:
    saved = _engine(0)
    _step(saved, 1)
    state = saved.state_dict()
    gathered = state[optimizer_state.PARAM_STATE_KEY].value  # an OwnFile straight from state_dict
    part = gathered[0][0][DTYPE_KEY]
    part["exp_avg"] = part["exp_avg"][:-1]
    fresh = _engine(1)
    before = fresh.optimizer._flat("param")
    with pytest.raises(EngineError, match="'exp_avg': 27 elements, this optimizer's buffer holds 28"):
        fresh.load_state_dict(state)
    assert torch.equal(fresh.optimizer._flat("param"), before)
    with pytest.raises(optimizer_state.OptimizerStateError, match="holds 2 distributed optimizers"):
        optimizer_state.scatter(fresh.optimizer, [gathered[0]] * 2)


def test_a_rank_that_does_not_read_the_file_checks_the_layout(tmp_path: Path) -> None:
    """DP rank > 0 refuses a state that does not fit from the layout in model.pt, before any collective and
    without the file (here a path that does not exist)."""
    saved = _engine(0)
    _step(saved, 1)
    state = saved.state_dict()
    layout = optimizer_state.layout(state[optimizer_state.PARAM_STATE_KEY].value)
    layout[0][0][DTYPE_KEY]["exp_avg_sq"] = 30
    state[optimizer_state.PARAM_STATE_KEY] = FileRef(tmp_path / "absent.pt")
    state[optimizer_state.PARAM_LAYOUT_KEY] = layout
    fresh = _engine(1)
    fresh.optimizer.data_parallel_group = SimpleNamespace(rank=lambda: 1, size=lambda: 2)
    with pytest.raises(EngineError, match="'exp_avg_sq': 30 elements, this optimizer's buffer holds 28"):
        fresh.load_state_dict(state)
    fresh.optimizer.data_parallel_group = SimpleNamespace(rank=lambda: 0, size=lambda: 2)  # reads: says which
    with pytest.raises(EngineError, match=r"absent\.pt: does not load .*remove that checkpoint directory"):
        fresh.load_state_dict(state)


def _flip(path: Path, moments: torch.Tensor) -> None:
    data = bytearray(path.read_bytes())
    at = bytes(data).find(moments.numpy().tobytes())  # the saved exp_avg's bytes inside the file
    assert at > 0
    data[at + 3] ^= 0x40  # torch.load alone would not notice
    path.write_bytes(bytes(data))


def _cut(path: Path, moments: torch.Tensor) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _remove(path: Path, moments: torch.Tensor) -> None:
    path.unlink()


DAMAGES = {
    "flip": (_flip, "SHA-256 differs"),
    "cut": (_cut, "bytes, the manifest says"),
    "removed": (_remove, "missing"),
}


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_parameter_state_falls_back_to_the_previous_checkpoint(tmp_path: Path, how: str) -> None:
    root = tmp_path / "ck"
    engine = _engine(0)
    for step in (1, 2):
        _step(engine, step)
        save_checkpoint(root, step, engine.state_dict(), rng_state={})
    damage, what = DAMAGES[how]
    damage(root / "step_000002" / optimizer_state.PARAM_STATE_FILE, engine.optimizer._flat("exp_avg"))
    loaded = load_latest(root)
    assert loaded is not None and loaded.step == 1
    (line,) = loaded.skipped
    assert line.startswith(f"{root}/step_000002/{optimizer_state.PARAM_STATE_FILE}: "), line
    assert what in line
    assert checkpoint_verify.choose(root, deep=how == "flip").name == "step_000001"  # mopd-submit's check too
    fresh = _engine(7)
    fresh.load_state_dict(loaded.engine_state)
    straight = _engine(0)
    _step(straight, 1)
    assert all(
        torch.equal(a, b) for a, b in zip(_moments(straight).values(), _moments(fresh).values(), strict=True)
    )
    # a follower (not reading it) does not look: rank 0's load_latest chose for it
    assert load_checkpoint(root / "step_000002", verify_own_files=False).step == 2


def test_an_own_file_name_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    for name in ("../x.pt", "model.pt", ".hidden.pt", "x.bin"):
        with pytest.raises(CheckpointError, match="own file name"):
            save_checkpoint(tmp_path, 1, {"a": OwnFile(name, 1)}, rng_state={})
    with pytest.raises(CheckpointError, match="used once"):
        save_checkpoint(tmp_path, 1, {"a": OwnFile("x.pt", 1), "b": OwnFile("x.pt", 2)}, rng_state={})
    assert not any(tmp_path.iterdir())


DP_WORLD = 2
DP_TIMEOUT_S = 120


def _dp_rank(rank: int, tmp: str, answers: Any) -> None:
    """One rank of the 2-process gloo test (`test_dp_rank_1_never_opens_the_parameter_state`): answers
    (rank, report dict) or (rank, traceback)."""
    try:
        opened: list[str] = []  # every open() of the parameter state's file in this process
        sys.addaudithook(
            lambda event, args: (
                opened.append(str(args[0]))
                if event == "open" and optimizer_state.PARAM_STATE_FILE in str(args[0])
                else None
            )
        )
        store = dist.FileStore(f"{tmp}/store", DP_WORLD)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=DP_WORLD, timeout=timedelta(seconds=60)
        )
        group, root = dist.group.WORLD, Path(tmp) / "ck"
        saved = _engine(0, group)
        for k in (1, 2):
            _step(saved, k)
        state = saved.state_dict()  # a collective: the parameter state gathered on DP rank 0
        report: dict[str, Any] = {"state_on_this_rank": state[optimizer_state.PARAM_STATE_KEY] is not None}
        if rank == 0:
            save_checkpoint(root, 2, state, rng_state={})
        dist.barrier()
        at_two = {k: v.clone() for k, v in _moments(saved).items()}  # this rank's shard after step 2
        _step(saved, 3)
        fresh = _engine(7, group)  # other initial weights: everything from the checkpoint
        opened_before_load = list(opened)
        if rank == 0:  # the controller: load_latest (deep verification of every file), then the engine
            ckpt = load_latest(root)
        else:  # a follower: the directory rank 0 named, its own files left alone
            ckpt = load_checkpoint(root / "step_000002", verify_own_files=False)
        fresh.load_state_dict(ckpt.engine_state)  # the scatter: DP rank 0 reads, every rank joins
        report["shard_equal_after_load"] = all(torch.equal(_moments(fresh)[k], v) for k, v in at_two.items())
        _step(fresh, 3)
        report["weights_equal_after_step_3"] = all(
            torch.equal(a, b)
            for a, b in zip(saved.model.state_dict().values(), fresh.model.state_dict().values(), strict=True)
        )
        report["shard_equal_after_step_3"] = all(
            torch.equal(_moments(fresh)[k], v) for k, v in _moments(saved).items()
        )
        report["owned"] = fresh.optimizer.owned
        report["opened_before_load"] = opened_before_load
        report["opened"] = opened
        dist.destroy_process_group()
        answers.put((rank, report))
    except BaseException:
        answers.put((rank, traceback.format_exc()))


def spawn_ranks(target: Any, world: int, tmp: Path, timeout_s: float) -> dict[int, dict[str, Any]]:
    """`target(rank, str(tmp), answers)` in `world` spawned processes; each rank's report (a traceback fails)."""
    ctx = helpers_fork.context()  # forked with megatron-core imported (spawn's on a GPU machine)
    answers = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, str(tmp), answers), daemon=True) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        reports = dict(answers.get(timeout=timeout_s) for _ in range(world))
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    for rank, report in reports.items():
        assert isinstance(report, dict), f"rank {rank}:\n{report}"
    return reports


def test_dp_rank_1_never_opens_the_parameter_state(tmp_path: Path) -> None:
    reports = spawn_ranks(_dp_rank, DP_WORLD, tmp_path, DP_TIMEOUT_S)
    zero, one = reports[0], reports[1]
    assert zero["owned"] == [0] and one["owned"] == [1]  # each rank steps its own shard (weight / bias)
    assert zero["state_on_this_rank"] and not one["state_on_this_rank"]
    for report in (zero, one):  # bitwise: the shard after the load, the weights and shard after step 3
        assert report["shard_equal_after_load"] is True
        assert report["weights_equal_after_step_3"] is True and report["shard_equal_after_step_3"] is True
    own = str(tmp_path / "ck" / "step_000002" / optimizer_state.PARAM_STATE_FILE)
    assert own in zero["opened"]  # the instrument sees rank 0's verification and read
    assert one["opened"] == [] and one["opened_before_load"] == []  # rank 1 never opened it


def test_chained_optimizers_are_walked_in_order() -> None:
    a, b, c = object(), object(), object()
    chain = SimpleNamespace(chained_optimizers=[a, SimpleNamespace(chained_optimizers=[b, c])])
    assert optimizer_state.distributed_optimizers(chain) == [a, b, c]
    assert optimizer_state.distributed_optimizers(a) == [a]


def test_the_step_tensor_megatron_shares_is_separated() -> None:
    saved = _engine(0)
    _step(saved, 1)
    fresh = _engine(1)
    fresh.optimizer.load_state_dict(saved.optimizer.state_dict())
    weight, bias = fresh.optimizer.optimizer.state.values()
    assert weight["step"] is bias["step"]  # one tensor: each Adam step would add 2 to it
    assert optimizer_state.separate_steps(fresh.optimizer) == 1
    assert weight["step"] is not bias["step"] and weight["step"].item() == bias["step"].item() == 1.0
    assert optimizer_state.separate_steps(fresh.optimizer) == 0
