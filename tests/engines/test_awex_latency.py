"""awex 0.9.0 latency gaps 9, 10 and 11 (engines/weight_sync/awex_latency.py): the young-generation
`gc.collect()` that ends a separate-mode sync step, scoped to that step and thread, checked on awex's real
writer and reader step bodies (a `fake` torch.distributed group stands in for NCCL); the NPU probe run once per
process; `gc.freeze()` once per process, after which new garbage cycles are still collected. Timings are in
benchmarks/awex_step_overhead.py (gaps 9 and 10) and benchmarks/weight_sync.py (on GPUs)."""

from __future__ import annotations

import gc
import inspect
import textwrap
import threading
from pathlib import Path

import pytest
from helpers_scripts import run_report

from mopd_hpc.engines.weight_sync import awex_latency as gaps
from mopd_hpc.engines.weight_sync.awex import AwexUnavailableError, require_awex


def _awex_importable() -> bool:
    try:
        require_awex()
    except AwexUnavailableError:
        return False
    return True


#: Gaps 9 and 10 patch awex itself; gap 11 needs neither awex nor megatron.core.
needs_awex = pytest.mark.skipif(
    not _awex_importable(), reason="awex or megatron-core (the megatron extra) is not installed"
)


class _Recorder:
    """Stands in for the `gc` module under STEP_GC: records the generation of each collection."""

    def __init__(self) -> None:
        self.generations: list[int] = []

    def collect(self, generation: int = 2) -> int:
        self.generations.append(generation)
        return 0


@needs_awex
def test_gap9_installs_once_in_awex_writer_and_reader() -> None:
    import awex.reader.nccl_reader as nccl_reader
    import awex.writer.nccl_writer as nccl_writer

    from mopd_hpc.engines.weight_sync.awex_hf import register_hf_engine

    gaps.young_gc_in_separate_steps()
    gaps.young_gc_in_separate_steps()  # idempotent
    register_hf_engine()  # the reader's side applies it too
    assert nccl_writer.gc is gaps.STEP_GC and nccl_reader.gc is gaps.STEP_GC
    for cls, name in (
        (nccl_writer.NCCLWeightsWriter, "_write_weights"),
        (nccl_reader.NCCLWorkerWeightsReader, "_update_weights"),
    ):
        step = cls.__dict__[name]
        assert step._mopd_young_gc and not getattr(step.__wrapped__, "_mopd_young_gc", False)  # wrapped once
        assert step.__name__ == name
    # the colocate step bodies (whose collection must close CUDA IPC handles) are not scoped
    assert not getattr(nccl_writer.NCCLWeightsWriter._write_weights_in_colocate_mode, "_mopd_young_gc", False)
    assert not getattr(
        nccl_reader.NCCLWorkerWeightsReader._update_weights_in_colocate_mode, "_mopd_young_gc", False
    )
    assert gaps.STEP_GC.get_threshold() == gc.get_threshold() and gaps.STEP_GC.isenabled() == gc.isenabled()
    from mopd_hpc.engines.weight_sync.awex_actor import AwexActorPublisher

    source = inspect.getsource(AwexActorPublisher.__init__)
    assert "young_gc_in_separate_steps()" in source and "cached_device_probe()" in source  # the writer's side


@needs_awex
def test_gap9_collections_are_young_only_inside_a_step_of_this_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    recorder = _Recorder()
    monkeypatch.setattr(gaps, "gc", recorder)
    scoped = gaps.StepScopedGC()
    scoped.collect()  # outside a step: awex's full collection
    with scoped.step():
        scoped.collect()
        scoped.collect(0)  # an explicit younger generation is kept
        with scoped.step():  # re-entrant
            scoped.collect()
        scoped.collect()
        other = threading.Thread(target=scoped.collect)  # another thread is not in the step
        other.start()
        other.join()
    assert recorder.generations == [2, 1, 0, 1, 1, 2]
    with pytest.raises(RuntimeError, match="send failed"), scoped.step():
        raise RuntimeError("send failed")
    assert scoped.in_step is False
    scoped.collect(2)
    assert recorder.generations[-1] == 2 and gaps.YOUNG_GC_GENERATION == 1

    def step(self: object, value: int) -> tuple[object, int, bool]:
        gaps.STEP_GC.collect()
        return self, value, gaps.STEP_GC.in_step

    wrapped = gaps._young_gc_step(step)
    assert gaps._young_gc_step(wrapped) is wrapped
    assert wrapped("writer", 3) == ("writer", 3, True) and recorder.generations[-1] == 1
    assert gaps.STEP_GC.in_step is False


_STEPS = textwrap.dedent(
    """
    import gc, json, weakref, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    from types import SimpleNamespace
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from awex.util.process_group import init_custom_process_group
    import awex.writer.nccl_writer as nccl_writer, awex.reader.nccl_reader as nccl_reader
    from awex.writer.nccl_writer import NCCLWeightsWriter
    from awex.reader.nccl_reader import NCCLWorkerWeightsReader
    from mopd_hpc.engines.weight_sync import awex_latency as gaps

    gaps.young_gc_in_separate_steps()
    generations = []
    class Recorder:
        def collect(self, generation=2):
            generations.append(generation)
            return gc.collect(generation)
    gaps.gc = Recorder()
    gc.collect()
    gc.disable()  # only the step's own collection may free anything
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    names = [n for n, _ in model.named_parameters()]
    alive, sent = [], []

    class Holder:  # a converted tensor kept alive only by a reference cycle
        pass

    class Converter:
        def convert_param(self, name, param, vp_stage=None):
            copy = param.detach().clone()  # awex's converters make copies (e.g. the q/k/v split)
            alive.append(weakref.ref(copy))
            if name == names[0]:
                holder = Holder()
                holder.me, holder.tensor = holder, copy
            return [(name, copy)]

    def plan(key, slices):
        ops = [SimpleNamespace(send_shard_meta=SimpleNamespace(name=n), recv_shard_meta=SimpleNamespace(name=n),
                               train_slices=(slice(None),), inf_slices=(slice(None),)) for n in names]
        return SimpleNamespace(operations={key: ops})

    real_send_recv = nccl_writer.batch_send_recv
    def record(send_ops, recv_ops, **kw):
        sent.extend((op.op.__name__, op.peer, float(op.tensor.sum())) for op in list(send_ops) + list(recv_ops))
        return real_send_recv(send_ops, recv_ops, **kw)
    nccl_writer.batch_send_recv = nccl_reader.batch_send_recv = record

    common = dict(use_batch_send_recv=True, already_initialized=True, destroy_pg_after_update=False,
                  enable_mem_debug=False, enable_colocate_mode=False)
    writer = object.__new__(NCCLWeightsWriter)
    writer.__dict__.update(common, model=[model], weight_converter=Converter(), transfer_rank=1,
        hf_config=SimpleNamespace(tie_word_embeddings=False), rank_info=SimpleNamespace(pp_rank=0, pp_size=1),
        transfer_plan=plan(0, "train_slices"), recv_ranks_sample=[0], num_to_sends=len(names),
        required_param_names=set(names), _history_write_weights_time={},
        weights_update_group=init_custom_process_group(backend="fake", store=FakeStore(), world_size=2, rank=1,
                                                       group_name="writer"))
    writer._write_weights(1)
    report = {"writer_generations": list(generations), "converted": len(alive),
              "alive_after_writer_step": sum(ref() is not None for ref in alive),
              "sent": sent[:], "expected": [float(p.sum()) for p in model.parameters()]}
    generations.clear(); sent.clear()
    reader = object.__new__(NCCLWorkerWeightsReader)
    params = dict(model.named_parameters())
    reader.__dict__.update(common, parameters=params, transfer_plan=plan(1, "inf_slices"), transfer_rank=0,
        send_ranks_sample=[1], rank_coordinate="0-0-0", num_to_recvs=len(names), _history_update_weights_time={},
        weights_update_group=init_custom_process_group(backend="fake", store=FakeStore(), world_size=2, rank=0,
                                                       group_name="reader"))
    reader._update_weights(1)
    report.update(reader_generations=list(generations), received=sent[:], outside_step=[])
    generations.clear()
    nccl_writer.gc.collect()  # as the colocate paths call it: outside a separate step
    report["outside_step"] = list(generations)
    print(json.dumps(report))
    """
)


@needs_awex
def test_gap9_real_awex_separate_steps_collect_young_and_free_their_tensors(tmp_path: Path) -> None:
    """awex's own `_write_weights` / `_update_weights` on a fake group: each ends with one young collection,
    every converted copy is freed when the step returns (also one held only by a reference cycle, with the
    automatic collector off), the sends carry the parameters' values, and collections outside a step stay full."""
    report = run_report(tmp_path, _STEPS, timeout_s=180, name="steps.py")
    assert report["writer_generations"] == [1] and report["reader_generations"] == [1]
    assert report["outside_step"] == [2]
    assert report["converted"] == 4 and report["alive_after_writer_step"] == 0
    assert [(op, peer) for op, peer, _ in report["sent"]] == [("isend", 0)] * 4
    assert [total for _, _, total in report["sent"]] == pytest.approx(report["expected"])
    assert [(op, peer) for op, peer, _ in report["received"]] == [("irecv", 1)] * 4


@needs_awex
def test_gap10_npu_probe_runs_once_and_the_override_still_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    import awex.util.device as device_util

    gaps.cached_device_probe()
    gaps.cached_device_probe()  # idempotent
    probe = device_util.is_npu_available
    assert probe._mopd_probe_once and not getattr(probe.__wrapped__, "_mopd_probe_once", False)
    calls: list[int] = []

    def original() -> bool:
        calls.append(1)
        return False

    cached = gaps._probe_once(original)
    assert [cached() for _ in range(3)] == [False] * 3 and calls == [1]
    assert gaps._probe_once(cached) is cached
    monkeypatch.delenv("AWEX_DEVICE_TYPE", raising=False)
    import torch

    assert device_util.get_device_type() == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("AWEX_DEVICE_TYPE", "npu")  # read on every call, as in awex
    assert device_util.get_device_type() == "npu"


_FREEZE = textwrap.dedent(
    """
    import gc, json, weakref
    from mopd_hpc.engines.weight_sync import awex_latency

    class Node:
        pass

    def cycle():
        node = Node()
        node.me = node
        return node

    before = gc.get_freeze_count()
    old = [cycle()]  # alive at the freeze: frozen with the rest
    old_ref = weakref.ref(old[0])
    report = {"before": before, "calls": [awex_latency.freeze_long_lived_objects()]}
    report["frozen"] = gc.get_freeze_count()
    report["calls"].append(awex_latency.freeze_long_lived_objects())
    gc.disable()  # only the explicit collection below may free anything
    new_ref = weakref.ref(cycle())  # created after the freeze, unreachable at once
    old.clear()  # the frozen cycle becomes unreachable too
    report["new_alive_before_collect"] = new_ref() is not None
    gc.collect()
    report["new_alive_after_collect"] = new_ref() is not None
    report["old_alive_after_collect"] = old_ref() is not None
    report["calls"].append(awex_latency.freeze_long_lived_objects())
    report["after"] = gc.get_freeze_count()
    print(json.dumps(report))
    """
)


def test_gap11_freezes_once_and_later_garbage_cycles_are_still_collected(tmp_path: Path) -> None:
    """Gap 11 in a fresh process (gc.freeze acts on the whole process): the first call freezes (True), later
    calls do nothing (False, the freeze count unchanged); a reference cycle created after the freeze is
    collected by a full `gc.collect()`, while one frozen and dropped later is not (gc.freeze's documented
    trade-off, module docstring)."""
    report = run_report(tmp_path, _FREEZE, timeout_s=120, name="freeze.py")
    assert report["calls"] == [True, False, False]
    assert report["before"] == 0 and report["frozen"] > 0
    assert report["after"] == report["frozen"]
    assert report["new_alive_before_collect"] is True and report["new_alive_after_collect"] is False
    assert report["old_alive_after_collect"] is True
