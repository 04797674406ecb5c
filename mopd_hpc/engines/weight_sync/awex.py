"""AWEX weight sync (awex 0.9.0): the job plan → AWEX configuration, and the 0.9.0 gaps handled explicitly.

What AWEX needs (algo_awex.md §2, areal.md §4) and where it comes from here:
- transfer ranks: `JobPlan` children carry them (plan/transfer_ranks.py; AWEX's numbering: rollout engine e,
  rank j → e·(tp·pp) + j; trainer rank r → infer_world + r); `AwexJobConfig.from_plan` re-derives them
  with AWEX's formula and refuses a plan that disagrees;
- the MetaServer address: the actor's rank 0 starts the MetaServer and writes `run_dir/awex_meta_server.json`
  (`write_meta_server_address`); every other child reads it (`read_meta_server_address`); one MetaServer
  per actor ↔ rollout fleet pair (its keys are global);
- colocate or separate: from the plan's rollout mode (colocated → "colocate": CUDA IPC on shared GPUs,
  train_world must equal infer_world; separated → "separate": one NCCL group of infer_world + train_world).

awex 0.9.0 gaps, each handled here (tests/engines/test_awex_config.py):
1. `import awex` imports megatron.core (awex/__init__ → nccl_writer → weights_writer → mcore_converter),
   also on rollout nodes → `require_awex()` checks both first and names the fix.
2. `SGLangEngine.initialize()` does nothing unless `config.node_rank == 0`, and `InferenceConfig.node_rank`
   defaults to None → `inference_config()` always sets node_rank (0 for an engine's driver) and nnodes;
   `drives_reader(node_rank)` says which rollout child may build the AWEX reader.
3. colocate mode: `NCCLWeightsWriter._init_writer_in_colocate_mode` reads `self.asystem_train_config`,
   which nothing sets → `patch_colocate_writer(writer, ipc_backend)` sets it before the first write.
(4 and 5: the writer's, awex_actor.py; 6: the HF reader's, awex_hf.py.)
7. separate mode: awex builds its "weights_exchange" group with torch's private `_new_process_group_helper`
   (`awex.util.process_group.init_custom_process_group`). When the process's default group has a bound
   device (the Megatron actor's: `init_process_group(..., device_id=...)`, eager NCCL init), torch ≥ 2.3
   creates every new NCCL group by `ncclCommSplit` of the default group's communicator
   (`split_from = _get_split_source(default_group)` whatever the new group's members). The actor's default
   group is its own training world (one rank here), so the writer's "2-rank" group came out as a split of a
   1-rank communicator: the writer passed the group's first barrier alone (31 ms) while the reader, whose
   default group has no bound device, waited for it forever in a real 2-rank init — the hang seen on 2 H200s
   in session 2. `unsplit_custom_groups()` makes awex's group creation run with the default group's
   bound device cleared (restored right after), so the group is a fresh communicator of its own store's ranks
   on both sides. Found from torch's source (distributed_c10d._new_process_group_helper); on two H200s
   separate mode then ran (tests/engines/test_awex_hf_gpu.py[separate]: bitwise; tests/e2e/test_gpu_job.py, 3 steps).
(8–11: latency, in awex_latency.py.)

`awex_plan.simulate_transfer_plan` validates AWEX transfer plans of a job's rank layout on CPU (awex's own
TransferPlanBuilder, replayed on CPU tensors as in awex/tests/test_transfer_plan_cpu_sim.py).
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mopd_hpc.atomic import atomic_write_json
from mopd_hpc.config.rollout import AWEX_MODES
from mopd_hpc.records.run_dir import AWEX_META_SERVER_FILE
from mopd_hpc.runtime import child_env

#: File in the run directory holding the MetaServer address ({"host": ..., "port": ...}).
META_SERVER_FILE = AWEX_META_SERVER_FILE
#: HF architectures awex 0.9.0 registers (awex/models/registry.py); others fall back to generic converters.
REGISTERED_ARCHITECTURES = frozenset(
    {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"}
)
COMM_BACKENDS = ("nccl", "file")
IPC_BACKENDS = ("cuda", "cpu")


class AwexConfigError(ValueError):
    """The job cannot be served by AWEX as planned; the message names the field, the value, the fix."""


class AwexUnavailableError(ImportError):
    """awex (or megatron.core, which `import awex` needs in 0.9.0) is not importable in this process."""


def require_awex(find_spec: Callable[[str], Any] = importlib.util.find_spec) -> None:
    """Raise AwexUnavailableError unless `import awex` can succeed here (gap 1: it needs megatron.core,
    also in rollout processes, which never use it)."""
    for module, why in (
        ("awex", "the awex extra is not installed (pip install 'mopd_hpc[awex]')"),
        (
            "megatron.core",
            "awex 0.9.0's `import awex` imports megatron.core (awex/__init__ → writer/nccl_writer → "
            "converter/mcore_converter), also in rollout processes: install megatron-core there too "
            "(the megatron extra)",
        ),
    ):
        try:
            found = find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise AwexUnavailableError(f"cannot use weight_sync.backend 'awex': {module} is missing; {why}")


# ------------------------------------------------------------ gap 7: awex's custom groups, not split


def _unsplit(original: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(original, "_mopd_unsplit", False):
        return original

    def init_custom_process_group(*args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
        bound = getattr(default, "bound_device_id", None)
        if bound is None:
            return original(*args, **kwargs)
        default.bound_device_id = None  # no ncclCommSplit of the trainer's own world (gap 7)
        try:
            return original(*args, **kwargs)
        finally:
            default.bound_device_id = bound

    init_custom_process_group._mopd_unsplit = True  # type: ignore[attr-defined]
    init_custom_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    return init_custom_process_group


def unsplit_custom_groups() -> None:
    """Gap 7 (module docstring): awex's custom process groups are built as fresh communicators, never split
    from the default group. Idempotent.

    Raises:
        AwexUnavailableError: awex or megatron.core is not importable.
    """
    require_awex()
    module = importlib.import_module("awex.util.process_group")
    module.init_custom_process_group = _unsplit(module.init_custom_process_group)


# ------------------------------------------------------------------------------------ MetaServer address


def write_meta_server_address(run_dir: str | Path, host: str, port: int) -> Path:
    """Record the MetaServer address in `run_dir/awex_meta_server.json` (atomically). Returns the path."""
    if not host or not 0 < int(port) < 65536:
        raise AwexConfigError(f"MetaServer address host={host!r} port={port!r}: expected a host and 1..65535")
    path = Path(run_dir) / META_SERVER_FILE
    atomic_write_json(path, {"host": host, "port": int(port)})
    return path


def read_meta_server_address(run_dir: str | Path, timeout_s: float = 0.0, poll_s: float = 0.2) -> str:
    """The MetaServer address "host:port" from the run directory, waiting up to `timeout_s` for the actor's
    rank 0 to write it. Raises AwexConfigError naming the file when it is absent or malformed."""
    path = Path(run_dir) / META_SERVER_FILE
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return f"{data['host']}:{int(data['port'])}"
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise AwexConfigError(
                    f"{path} does not exist after {timeout_s} s: the actor's rank 0 writes it when it starts "
                    "the AWEX MetaServer"
                ) from None
            time.sleep(poll_s)
        except (ValueError, KeyError, TypeError) as exc:
            raise AwexConfigError(
                f"{path} is malformed ({exc}); expected {{'host': str, 'port': int}}"
            ) from None


# ------------------------------------------------------------------------------------------ job config


@dataclass(frozen=True, slots=True)
class AwexJobConfig:
    """AWEX settings of one actor ↔ rollout fleet pair, derived from the job plan. Build with `from_plan`.

    Fields: mode ("colocate" | "separate"); comm_backend ("nccl" | "file"); ipc_backend ("cuda" | "cpu",
    colocate only); meta_server_addr ("host:port", "" until known); num_engines, engine_tp, engine_pp (the
    rollout fleet, dp 1 per engine); infer_world = num_engines·tp·pp; train_world; model_arch (HF).
    """

    mode: str
    comm_backend: str
    ipc_backend: str
    meta_server_addr: str
    num_engines: int
    engine_tp: int
    engine_pp: int
    infer_world: int
    train_world: int
    model_arch: str

    @classmethod
    def from_plan(
        cls,
        plan: Any,
        *,
        meta_server_addr: str = "",
        comm_backend: str = "nccl",
        ipc_backend: str = "cuda",
        model_arch: str = "Qwen3ForCausalLM",
    ) -> AwexJobConfig:
        """From a `runtime.plan.JobPlan` (its children's transfer ranks, rollout tp and mode).

        Raises:
            AwexConfigError: a backend name not known; an architecture awex does not register; transfer
                ranks that differ from AWEX's numbering; colocate with train_world != infer_world.
        """
        if comm_backend not in COMM_BACKENDS or ipc_backend not in IPC_BACKENDS:
            raise AwexConfigError(
                f"comm_backend={comm_backend!r}, ipc_backend={ipc_backend!r}: expected one of {COMM_BACKENDS} "
                f"and one of {IPC_BACKENDS}"
            )
        if model_arch not in REGISTERED_ARCHITECTURES:
            raise AwexConfigError(
                f"model_arch={model_arch!r} is not registered in awex 0.9.0 (known: "
                f"{', '.join(sorted(REGISTERED_ARCHITECTURES))}); its converters would fall back to generic ones"
            )
        rollouts = sorted(plan.by_role("rollout"), key=lambda c: c.index)
        actors = sorted(plan.by_role("actor"), key=lambda c: c.index)
        if not rollouts or not actors:
            raise AwexConfigError(
                f"plan {plan.name!r} has {len(actors)} actor and {len(rollouts)} rollout children"
            )
        tp = int(rollouts[0].env_dict.get(child_env.ROLLOUT_TP, "1"))
        infer_world = len(rollouts) * tp
        for child in rollouts:
            want = tuple(range(child.index * tp, (child.index + 1) * tp))
            if child.transfer_ranks != want:
                raise AwexConfigError(
                    f"{child.label}: transfer_ranks={child.transfer_ranks}, AWEX expects {want}"
                )
        for child in actors:
            want = (infer_world + child.index,)
            if child.transfer_ranks != want:
                raise AwexConfigError(
                    f"{child.label}: transfer_ranks={child.transfer_ranks}, AWEX expects {want}"
                )
        mode = AWEX_MODES[plan.mode]
        if mode == "colocate" and len(actors) != infer_world:
            raise AwexConfigError(
                f"AWEX colocate pairs each trainer rank with one rollout rank on the same GPU: train_world="
                f"{len(actors)} != infer_world={infer_world} (engines·tp); use rollout.mode: separated"
            )
        return cls(
            mode=mode,
            comm_backend=comm_backend,
            ipc_backend=ipc_backend,
            meta_server_addr=meta_server_addr,
            num_engines=len(rollouts),
            engine_tp=tp,
            engine_pp=1,
            infer_world=infer_world,
            train_world=len(actors),
            model_arch=model_arch,
        )

    @property
    def colocate(self) -> bool:
        return self.mode == "colocate"

    def with_meta_server(self, address: str) -> AwexJobConfig:
        """The same settings with the MetaServer address ("host:port") filled in."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise AwexConfigError(f"meta_server_addr={address!r}: expected 'host:port'")
        fields = {name: getattr(self, name) for name in self.__slots__}
        return AwexJobConfig(**{**fields, "meta_server_addr": address})

    def _need_address(self) -> None:
        if not self.meta_server_addr:
            raise AwexConfigError("meta_server_addr is empty: read it with read_meta_server_address(run_dir)")

    def trainer_config(self) -> dict[str, Any]:
        """The `config` dict of `awex.engine.mcore.MegatronEngine(config, hf_config, model)` (keys it reads)."""
        self._need_address()
        return {
            "meta_server_addr": self.meta_server_addr,
            "comm_backend": self.comm_backend,
            "enable_colocate_mode": self.colocate,
            "weights_exchange_ipc_backend": self.ipc_backend,
            "enable_debug_mode": False,
            "weights_validation_steps": 0,
            "disable_weights_exchange_pipeline": False,
        }

    def inference_config(self, engine_rank: int, node_rank: int = 0, nnodes: int = 1) -> dict[str, Any]:
        """The dict for `awex.InferenceConfig.from_dict` of one rollout engine's child on node `node_rank`.

        node_rank and nnodes are always set (gap 2: InferenceConfig.node_rank defaults to None, and
        SGLangEngine.initialize() silently skips the reader unless node_rank == 0).
        """
        self._need_address()
        if not 0 <= engine_rank < self.num_engines or not 0 <= node_rank < nnodes:
            raise AwexConfigError(
                f"engine_rank={engine_rank}, node_rank={node_rank}: expected engine_rank in [0, {self.num_engines}) "
                f"and node_rank in [0, nnodes={nnodes})"
            )
        return {
            "tp_size": self.engine_tp,
            "pp_size": self.engine_pp,
            "dp_size": 1,
            "nnodes": nnodes,
            "node_rank": node_rank,
            "num_engines": self.num_engines,
            "engine_rank": engine_rank,
            "meta_server_addr": self.meta_server_addr,
            "comm_backend": self.comm_backend,
            "enable_colocate_mode": self.colocate,
            "enable_memory_saver": True,
            "weights_exchange_ipc_backend": self.ipc_backend,
        }

    def trainer_env(self, trainer_rank: int, host_ip: str, device_index: int) -> dict[str, str]:
        """Environment of trainer rank r's process: AWEX reads AWEX_MASTER_ADDR (else it probes 8.8.8.8)
        and DEVICE (its CUDA ordinal)."""
        if not 0 <= trainer_rank < self.train_world:
            raise AwexConfigError(f"trainer_rank={trainer_rank}: expected [0, {self.train_world})")
        return {"AWEX_MASTER_ADDR": host_ip, "DEVICE": str(device_index)}

    def transfer_rank(self, role: str, index: int, rank_in_engine: int = 0) -> int:
        """AWEX's numbering (algo_awex.md §2.3): rollout e·tp·pp + j, actor infer_world + r."""
        if role == "rollout":
            return index * self.engine_tp * self.engine_pp + rank_in_engine
        if role == "actor":
            return self.infer_world + index
        raise AwexConfigError(f"role={role!r} has no AWEX transfer rank; expected 'rollout' or 'actor'")


def drives_reader(node_rank: int) -> bool:
    """Gap 2: only node 0 of a rollout engine builds and initializes the AWEX reader."""
    return node_rank == 0


def patch_colocate_writer(writer: Any, ipc_backend: str = "cuda") -> Any:
    """Gap 3: give an awex 0.9.0 `NCCLWeightsWriter` the `asystem_train_config` its colocate init reads
    (never set by awex). Idempotent; an existing attribute is kept. Returns the writer."""
    if ipc_backend not in IPC_BACKENDS:
        raise AwexConfigError(f"ipc_backend={ipc_backend!r}: expected one of {IPC_BACKENDS}")
    if getattr(writer, "asystem_train_config", None) is None:
        writer.asystem_train_config = {"weights_exchange_ipc_backend": ipc_backend}
    return writer
