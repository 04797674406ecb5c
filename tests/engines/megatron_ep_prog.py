"""One rank of tests/engines/test_megatron_ep_cpu.py: the megatron actor (`MegatronTrainEngine`, its real
constructor: megatron-core's GPTModel with MoE layers, its DDP and its distributed optimizer) on CPU over a
real gloo group, at the expert-parallel size given.

megatron-core's DDP buffers, distributed optimizer and RoPE allocate on CUDA; this host has none, so the
CUDA placements are pointed at the CPU: `torch.cuda.current_device()` answers "cpu", a TorchFunctionMode turns
every `device="cuda"` into the CPU and answers a CPU tensor's `.type()` as its CUDA name (the optimizer's
dtype check), and the router's gating (a CUDA move, then a linear) is the linear. The computation is
megatron-core's own: its MoE layers with the allgather token dispatcher over the EP group (all_gather_into_
tensor, reduce_scatter_tensor: gloo runs both), its DDP's dense and expert buffers (the expert grads reduced
over the expert-data-parallel group), its distributed optimizer (Adam, clipping over every rank's norm).

The model is built with megatron's CPU initialization (no CUDA RNG tracker here), then loaded.
argv: rank, world, expert_parallel, store file, HF checkpoint dir, out dir[, a checkpoint of step 1 to resume].
2 train steps (the stats and the synced weights before and after each), the checkpoint of step 1 written
(`{out}/ckpt_ep{EP}.pt`: the engine's state_dict, by rank 0), then a fresh engine loads that checkpoint (or
the one given: another EP size's) and takes step 2 again ("loaded", "resumed_stats", "resumed").
Writes (rank 0): `{out}/ep{EP}.pt`.
"""

import sys
import warnings

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

warnings.filterwarnings("ignore")
rank, world, ep, store, ckpt, out = sys.argv[1:7]
rank, world, ep = int(rank), int(world), int(ep)
load = sys.argv[7] if len(sys.argv) > 7 else None


class OnCpu(TorchFunctionMode):
    """CUDA placements on the CPU (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "cuda" in str(kwargs.get("device", "")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


OnCpu().__enter__()
torch.cuda.current_device = lambda: "cpu"
torch.cuda.synchronize = lambda *a, **k: None
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.transformer.moe import router  # noqa: E402

router.TopKRouter.gating = lambda self, x: torch.nn.functional.linear(x, self.weight)
parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)

import functools  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

from mopd_hpc.config.loss import LossConfig  # noqa: E402
from mopd_hpc.config.models import OptimizerConfig  # noqa: E402
from mopd_hpc.engines.batch import TrainBatch  # noqa: E402
from mopd_hpc.engines.megatron import build  # noqa: E402
from mopd_hpc.engines.megatron import model as megatron_model  # noqa: E402
from mopd_hpc.engines.megatron.engine import MegatronTrainEngine  # noqa: E402
from mopd_hpc.trainer.shards import shard_rows  # noqa: E402

sys.path.insert(0, "tests/engines")  # run from the repository (helpers_ranks.run_ranks)
from helpers_ep import ep_batch  # noqa: E402

torch.manual_seed(0)
hf_config = json.loads((Path(ckpt) / "config.json").read_text())
# megatron's CUDA RNG tracker does not exist here: its CPU initialization (the checkpoint's weights follow)
build.build_gpt_model = functools.partial(megatron_model.build_gpt_model, cpu_init=True)
loss = LossConfig(router_z_loss_coefficient=0.01)  # c_lb: the checkpoint's router_aux_loss_coef


def make_engine() -> MegatronTrainEngine:
    """This rank's engine from the HF checkpoint (its EP rank's experts)."""
    model, shape = build.build_from_hf(ckpt, hf_config, "float32", torch.device("cpu"))
    return MegatronTrainEngine(
        model, shape, hf_config, loss, OptimizerConfig(lr=1e-2, grad_clip=1.0, schedule="cosine"),
        torch.device("cpu"), "float32", total_steps=3,
    )  # fmt: skip


engine = make_engine()
model = engine.model

# the allgather dispatcher gathers the same number of tokens from each EP rank: both shards are [2, 6] (their
# response widths differ: 3 and 4); shard_rows splits these rows {0, 1}, {2, 3}
ROWS = [[1, 2, 3, 11, 12, 13], [4, 5, 15, 9, 22, 23], [6, 7, 8, 9, 16, 17], [3, 9, 10, 11, 12, 27]]
STARTS = [3, 3, 2, 4]


def batch(step: int) -> TrainBatch:
    """This rank's shard of step `step`'s rows (the same for every EP size)."""
    lengths = [len(r) - s for r, s in zip(ROWS, STARTS, strict=True)]
    shard = shard_rows(lengths, world)[rank]
    return ep_batch(step, ROWS, STARTS, shard.start, shard.stop)


def weights(actor: MegatronTrainEngine) -> dict[str, torch.Tensor]:
    """What the weight sync sends (every rank joins the EP gather; rank 0 keeps it)."""
    return {k: v.clone() for k, v in actor.named_weights()}


def stats_of(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if not k.startswith("time/")}


record: dict = {
    "stats": [],
    "weights": [],
    "local_experts": sum("local_experts" in k for k in model.state_dict()),
    "rank_params": sum(p.numel() for p in model.parameters()),  # what the memory plan counts a rank
    "initial": weights(engine),
}
for step in range(2):
    record["stats"].append(stats_of(engine.train_step(batch(step))))
    record["weights"].append(weights(engine))
    if step == 0:
        state = engine.state_dict()  # a collective over the DP (and EP) group
        if rank == 0:
            torch.save(state, f"{out}/ckpt_ep{ep}.pt")
dist.barrier()
# a fresh engine loads a checkpoint of step 1 (this run's, or `load`: another EP size's) and takes step 2
fresh = make_engine()
fresh.load_state_dict(torch.load(load or f"{out}/ckpt_ep{ep}.pt", weights_only=False))
record["loaded"] = weights(fresh)
record["resumed_stats"] = stats_of(fresh.train_step(batch(1)))
record["resumed"] = weights(fresh)
if rank == 0:
    torch.save(record, f"{out}/ep{ep}.pt")
dist.barrier()
