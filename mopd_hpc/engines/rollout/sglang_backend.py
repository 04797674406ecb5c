"""The sglang rollout backend: our HTTP surface over an in-process `sglang.Engine` (SGLang 0.5.17: the versions
the role runs are `config/capabilities.py` ROLLOUT_BACKENDS["sglang"].versions).

Why in-process: AWEX's reader hooks (`install_sglang_worker_hooks`, `Engine.execute_task_in_model_worker`)
need the Python Engine, and SGLang's own HTTP server has no AWEX route (algo_awex.md §2.6). The server
speaks the same subset as the hf backend (DESIGN.md §5), so the trainer cannot tell them apart.

Mapping rules (pure functions, tested without sglang in tests/engines/test_sglang_backend.py):
- ports come from the guard's named leases, never positional: `http` → `--port`, `nccl` → `--nccl-port`,
  `dist_init` → the port of `--dist-init-addr host:port` (`SGLangLaunch.from_ports`). Our aiohttp server
  listens on `http`; SGLang's Engine gets the same number as its (unused) `port`, so its derived internal
  ports stay inside our lease's neighbourhood (algo_awex.md §3.1).
- the memory saver is on (`enable_memory_saver`): /release_memory_occupation and /resume_memory_occupation
  with tags kv_cache, weights, cuda_graph need it; `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`
  silently disables torch_memory_saver (areal.md §4), so `check_environment` refuses it.
- log-probs: SGLang returns log-probs of logits / temperature — the behavior policy μ the trainer needs
  (0.5.17 on the lead's H100 probe: within 0.045 nats of a direct bf16 forward at T = 0.7, 0.027 at T = 1;
  at T = 0, greedy: the evaluation, where μ is not used, T = 1 log-probs).
  `SGLANG_RETURN_ORIGINAL_LOGPROB=1` would return T = 1 log-probs: refused by `check_environment`.
- response shape (io_struct.py; 0.5.17 on the H100 probe): `meta_info.output_token_logprobs` is a list of
  (logprob, token_id, text|None) triples, one per output id; `input_token_logprobs[0]` is None (the first
  prompt token has no prediction). `check_item` validates both and builds a `GeneratedSample`.
- kernels and graphs: what SGLang 0.5.17 started and sampled with on the lead's H100 probe
  (benchmarks/sglang_probe.py): `skip_tokenizer_init` (the trainer sends input_ids; items carry no text),
  attention_backend "triton", sampling_backend "pytorch", decode CUDA graphs up to the rows one engine decodes
  (`cuda_graph_max_bs_decode`, `graph_shape.graph_rows`), no prefill CUDA graphs (`disable_prefill_cuda_graph`:
  capturing them took 63 of a 95 s start there).
- readiness: an ordinary instance keeps SGLang's generating `/health` probe (a 1-token generation);
  an AWEX-launched instance starts with its weights released (AWEX colocate `initialize()`), so a
  generating probe would fail: it is ready when `/model_info` answers (`readiness_path`).
- the job's token: every route of the server (`sglang_server.py`) requires it (`sglang_app`,
  `runtime/http_auth.py`); without it, `GET /health` is the bare liveness probe (200 `{"status": "ok"}`, no
  generation): the readiness probe sends the token.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mopd_hpc.engines.request_fields import RolloutRequestError
from mopd_hpc.engines.rollout.protocol import GeneratedSample, GenerateRequest
from mopd_hpc.runtime.child_env import port_env_name

log = logging.getLogger("mopd_hpc.engines.rollout.sglang")

#: Named ports of a rollout child (DESIGN.md §4) and the ServerArgs field each one feeds.
PORT_FIELDS = {"http": "port", "nccl": "nccl_port", "dist_init": "dist_init_addr"}
#: Probe of an ordinary instance (SGLang 0.5.23: a 1-token generation) and of an AWEX-launched one.
HEALTH_PATH, AWEX_READY_PATH = "/health", "/model_info"


class SGLangBackendError(ValueError):
    """A launch setting, environment variable or SGLang response does not fit the backend's rules; the
    message names the field or variable, its value and what was expected."""


@dataclass(frozen=True, slots=True)
class SGLangLaunch:
    """Arguments of one in-process `sglang.Engine` (ServerArgs names). Build with `from_ports`.

    Fields: model_path; host (our HTTP bind address and the dist-init host); port, nccl_port,
    dist_init_port (from the named leases); tp_size (GPUs of the engine); base_gpu_id (its first device in
    the child's CUDA_VISIBLE_DEVICES); mem_fraction_static (of the GPU, for weights + KV cache);
    random_seed; dtype; enable_memory_saver (always True here); awex (launched for AWEX's reader);
    cuda_graph_max_bs (the largest decode batch captured in a CUDA graph: the rows one engine decodes in a
    step; None: SGLang's default).
    """

    model_path: str
    host: str
    port: int
    nccl_port: int
    dist_init_port: int
    tp_size: int = 1
    base_gpu_id: int = 0
    mem_fraction_static: float = 0.5
    random_seed: int = 0
    dtype: str = "bfloat16"
    enable_memory_saver: bool = True
    awex: bool = False
    cuda_graph_max_bs: int | None = None

    @classmethod
    def from_ports(
        cls, model_path: str, ports: Mapping[str, int], host: str = "127.0.0.1", **rest: Any
    ) -> SGLangLaunch:
        """Validate and build from the named ports {"http", "nccl", "dist_init"} (extra names ignored).

        Raises:
            SGLangBackendError: a named port missing or out of range, two names sharing a port, tp_size < 1,
                base_gpu_id < 0, mem_fraction_static not in (0, 1).
        """
        missing = [name for name in PORT_FIELDS if name not in ports]
        if missing:
            raise SGLangBackendError(
                f"named port(s) {missing} missing from {dict(ports)}; a rollout child leases "
                f"{list(PORT_FIELDS)} (http → --port, nccl → --nccl-port, dist_init → --dist-init-addr)"
            )
        used = {name: int(ports[name]) for name in PORT_FIELDS}
        for name, port in used.items():
            if not 0 < port < 65536:
                raise SGLangBackendError(f"port {name}={port}: expected 1..65535")
        if len(set(used.values())) != len(used):
            raise SGLangBackendError(f"named ports {used} share a number; each name needs its own port")
        launch = cls(model_path, host, used["http"], used["nccl"], used["dist_init"], **rest)
        if launch.tp_size < 1 or launch.base_gpu_id < 0:
            raise SGLangBackendError(
                f"tp_size={launch.tp_size}, base_gpu_id={launch.base_gpu_id}: expected >= 1, >= 0"
            )
        if launch.cuda_graph_max_bs is not None and launch.cuda_graph_max_bs < 1:
            raise SGLangBackendError(f"cuda_graph_max_bs={launch.cuda_graph_max_bs}: expected >= 1")
        if not 0 < launch.mem_fraction_static < 1:
            raise SGLangBackendError(f"mem_fraction_static={launch.mem_fraction_static}: expected (0, 1)")
        if not launch.enable_memory_saver:
            raise SGLangBackendError(
                "enable_memory_saver=False: release/resume of weights and kv_cache need it"
            )
        return launch

    @property
    def dist_init_addr(self) -> str:
        return f"{self.host}:{self.dist_init_port}"

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `sglang.Engine(**kw)` (ServerArgs fields, SGLang 0.5.17; module docstring)."""
        out = {
            "model_path": self.model_path,
            "host": self.host,
            "port": self.port,
            "nccl_port": self.nccl_port,
            "dist_init_addr": self.dist_init_addr,
            "nnodes": 1,
            "node_rank": 0,
            "tp_size": self.tp_size,
            "dp_size": 1,
            "base_gpu_id": self.base_gpu_id,
            "mem_fraction_static": self.mem_fraction_static,
            "random_seed": self.random_seed,
            "dtype": self.dtype,
            "enable_memory_saver": True,
            "skip_tokenizer_init": True,
            "attention_backend": "triton",
            "sampling_backend": "pytorch",
            "disable_prefill_cuda_graph": True,
        }
        if self.cuda_graph_max_bs is not None:
            out["cuda_graph_max_bs_decode"] = self.cuda_graph_max_bs
        return out

    def to_argv(self) -> list[str]:
        """The same settings as `python -m sglang.launch_server` flags (for logs and debugging)."""
        argv = []
        for key, value in self.engine_kwargs().items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                argv.append(flag)
            else:
                argv += [flag, str(value)]
        return argv


def ports_from_env(env: Mapping[str, str]) -> dict[str, int]:
    """The named ports the guard passed a child (`MOPD_PORT_HTTP`, ...), as {name: port}.

    Raises:
        SGLangBackendError: a variable missing or not an integer.
    """
    out = {}
    for name in PORT_FIELDS:
        key = port_env_name(name)
        raw = env.get(key)
        if raw is None or not raw.isdigit():
            raise SGLangBackendError(f"{key}={raw!r}: expected the port the guard leased for {name!r}")
        out[name] = int(raw)
    return out


def check_environment(env: Mapping[str, str], memory_saver: bool = True) -> None:
    """Refuse environments that silently break the backend's promises (module docstring)."""
    original = env.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "")
    if original.lower() in ("1", "true", "yes"):
        raise SGLangBackendError(
            f"SGLANG_RETURN_ORIGINAL_LOGPROB={original!r} makes SGLang return temperature-1 log-probs; the "
            "behavior policy μ is the sampling distribution: unset it"
        )
    alloc = env.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if memory_saver and "expandable_segments:true" in alloc.replace(" ", "").lower():
        raise SGLangBackendError(
            f"PYTORCH_CUDA_ALLOC_CONF={alloc!r}: torch_memory_saver disables itself with expandable segments, "
            "so released weights and KV cache would stay on the GPU; drop expandable_segments:True"
        )


def readiness_path(awex: bool) -> str:
    """The HTTP path whose 200 means ready: SGLang's generating /health, or /model_info under AWEX."""
    return AWEX_READY_PATH if awex else HEALTH_PATH


def generate_kwargs(req: GenerateRequest) -> dict[str, Any]:
    """Keyword arguments of `sglang.Engine.generate` for a validated /generate request.

    A prompt with n > 1 is expanded to n rows (SGLang's own `n` handling differs between versions);
    rows are prompt-major, row i·n + j being copy j of prompt i (sampling_seed + j when seeded).
    """
    if req.prompts is None:
        raise RolloutRequestError("text: the sglang backend takes input_ids (the trainer tokenizes)")
    ids, params, rids = [], [], []
    for i, (prompt, sp) in enumerate(zip(req.prompts, req.sampling, strict=True)):
        for j in range(sp.n):
            p = sp.to_json() | {"n": 1}
            if sp.sampling_seed is not None:
                p["sampling_seed"] = sp.sampling_seed + j
            ids.append(list(prompt))
            params.append(p)
            if req.rids:
                rids.append(req.rids[i] if sp.n == 1 else f"{req.rids[i]}-{j}")
    out: dict[str, Any] = {
        "input_ids": ids,
        "sampling_params": params,
        "return_logprob": req.return_logprob,
        "logprob_start_len": req.logprob_start_len,
        "top_logprobs_num": req.top_logprobs_num,
    }
    if rids:
        out["rid"] = rids
    return out


def check_item(
    item: Mapping[str, Any], prompt_ids: Sequence[int], return_logprob: bool, logprob_start_len: int = -1
) -> GeneratedSample:
    """Validate one SGLang response item (0.5.17's shape) and build the sample the trainer consumes.

    Checks: `meta_info.output_token_logprobs` has one (logprob, token_id, text|None) triple per output id,
    in order, each logprob finite and ≤ 0; with logprob_start_len = 0, `input_token_logprobs` has one entry
    per prompt token and its first entry is None.
    Raises:
        SGLangBackendError: naming the field, the value and what was expected.
    """
    meta = item.get("meta_info")
    if not isinstance(meta, Mapping) or "output_ids" not in item:
        raise SGLangBackendError(f"response item keys {sorted(item)}: expected 'output_ids' and 'meta_info'")
    output_ids = [int(t) for t in item["output_ids"]]
    if return_logprob:
        triples = meta.get("output_token_logprobs")
        if not isinstance(triples, list) or len(triples) != len(output_ids):
            got = len(triples) if isinstance(triples, list) else triples
            raise SGLangBackendError(
                f"meta_info.output_token_logprobs has {got} entries; expected one per output id ({len(output_ids)})"
            )
        for t, (triple, token) in enumerate(zip(triples, output_ids, strict=True)):
            if not isinstance(triple, list | tuple) or len(triple) != 3:
                raise SGLangBackendError(
                    f"meta_info.output_token_logprobs[{t}]={triple!r}: expected (logprob, token_id, text|None)"
                )
            lp, tok = triple[0], triple[1]
            if int(tok) != token:
                raise SGLangBackendError(
                    f"meta_info.output_token_logprobs[{t}] token {tok} != output_ids[{t}]={token}"
                )
            if lp is None or not math.isfinite(float(lp)) or float(lp) > 1e-6:
                raise SGLangBackendError(
                    f"meta_info.output_token_logprobs[{t}] logprob={lp!r}: expected finite <= 0"
                )
        if logprob_start_len == 0:
            inputs = meta.get("input_token_logprobs")
            if not isinstance(inputs, list) or len(inputs) != len(prompt_ids):
                raise SGLangBackendError(
                    f"meta_info.input_token_logprobs={inputs!r:.80}: expected one entry per prompt token "
                    f"({len(prompt_ids)})"
                )
            if (
                inputs
                and inputs[0] is not None
                and (not isinstance(inputs[0], list | tuple) or inputs[0][0] is not None)
            ):
                raise SGLangBackendError(
                    f"meta_info.input_token_logprobs[0]={inputs[0]!r}: expected None (SGLang: the first "
                    "prompt token has no prediction)"
                )
    else:
        item = {**item, "meta_info": {**meta, "output_token_logprobs": None}}
    if "finish_reason" not in meta or not isinstance(meta["finish_reason"], Mapping):
        raise SGLangBackendError(
            f"meta_info.finish_reason={meta.get('finish_reason')!r}: expected {{'type': ...}}"
        )
    return GeneratedSample.from_response(item, prompt_ids)
