"""The HF rollout engine's two decoders, in process, on real micro Qwen3 checkpoints.

Oracles: a direct full forward pass of the same checkpoint (log μ of the sampled tokens); the loop decoder
itself wherever no random draw is involved (greedy rows: the static decoder must give its tokens, finish
reasons, log-probs and weight version exactly); a pure-Python lowbias32 written here for the counter hash.
"""

from __future__ import annotations

import pytest
import torch
from helpers_models import save_micro_qwen3

from mopd_hpc.engines.rollout import counter_rng
from mopd_hpc.engines.rollout.hf_engine import HFRolloutEngine
from mopd_hpc.engines.rollout.protocol import SamplingParams
from mopd_hpc.engines.rollout.rows import RowRequest

PROMPTS = [(1, 2, 3, 4), (5, 6), (7, 8, 9, 10, 11, 12), (3,)]
TOL = 1e-5  # fp32 CPU: the same arithmetic up to reduction order
CUDA_FP32_TOL = 1e-4  # fp32 CUDA engine vs fp32 CPU oracle: kernels differ in reduction order only
# bf16 CUDA, against the same bf16 model's full forward: both round every activation and the logits to bf16
# (8 significant bits), but with other kernels (one-token GEMMs and SDPA over the cache vs the full causal
# pass), so a logit may differ by a few bf16 ulps. Here |logit| <= 4.3 (ulp 2**-5 = 0.031; measured: bf16 vs
# fp32 of this checkpoint differ by <= 0.071 nats): the bound asserted is 3 ulps of the largest logit, 0.1
# nats, on the log-softmax difference of the two bf16 paths.
CUDA_BF16_TOL = 0.1

DEVICES = [
    pytest.param("cpu", "float32", id="cpu-fp32"),
    pytest.param(
        "cuda", "float32", id="cuda-fp32",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ),
    pytest.param(
        "cuda", "bfloat16", id="cuda-bf16",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ),
]  # fmt: skip


class Gate:
    """A StepGate that counts its calls, runs `on_step(k)` at call k, and says False from call `abort_at`."""

    def __init__(self, abort_at: int | None = None, on_step=None) -> None:
        self.calls, self.abort_at, self.on_step = 0, abort_at, on_step

    def between_steps(self) -> bool:
        k, self.calls = self.calls, self.calls + 1
        if self.on_step is not None:
            self.on_step(k)
        return self.abort_at is None or k < self.abort_at


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_micro_qwen3(tmp_path_factory.mktemp("d0") / "model", seed=0, initializer_range=0.2)


@pytest.fixture(scope="module")
def ckpt_other(tmp_path_factory):
    return save_micro_qwen3(tmp_path_factory.mktemp("d1") / "model", seed=1, initializer_range=0.2)


@pytest.fixture(scope="module")
def oracle(ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def engine(ckpt, decoder: str, device: str = "cpu", dtype: str = "float32") -> HFRolloutEngine:
    torch.set_num_threads(1)
    return HFRolloutEngine.load(str(ckpt), device, dtype, decoder=decoder)


def row(prompt, seed: int = 0, **sampling) -> RowRequest:
    return RowRequest(tuple(prompt), SamplingParams(**sampling), seed=seed, return_logprob=True)


def oracle_logp(model, ids, temperature: float, device: str = "cpu") -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0].float().cpu()
    return torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)


@pytest.mark.parametrize(("device", "dtype"), DEVICES)
@pytest.mark.parametrize("decoder", ["loop", "static"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_returned_logprobs_equal_direct_forward(ckpt, oracle, device, dtype, decoder, temperature):
    eng = engine(ckpt, decoder, device, dtype)
    assert eng.decoder == decoder
    rows = [
        row(p, seed=3 + i, max_new_tokens=12, temperature=temperature, ignore_eos=True)
        for i, p in enumerate(PROMPTS)
    ]
    results = eng.generate(rows, Gate())
    ref_model, tol = oracle, TOL
    if device == "cuda":
        ref_model = eng.model if dtype == "bfloat16" else oracle
        tol = CUDA_BF16_TOL if dtype == "bfloat16" else CUDA_FP32_TOL
    for r, res in zip(rows, results, strict=True):
        assert len(res.output_ids) == 12 and res.finish == {"type": "length", "length": 12}
        ids = list(r.prompt_ids) + res.output_ids
        ref = oracle_logp(ref_model, ids, temperature, device if ref_model is eng.model else "cpu")
        n = len(r.prompt_ids)
        expected = torch.tensor([float(ref[n - 1 + t, tok]) for t, tok in enumerate(res.output_ids)])
        got = torch.tensor(res.output_logprobs)
        assert (got - expected).abs().max() <= tol, (got, expected)
        if temperature == 0.0 and dtype == "float32":
            assert res.output_ids == [int(ref[n - 1 + t].argmax()) for t in range(12)]


@pytest.mark.parametrize(("device", "dtype"), DEVICES)
def test_static_top_p_top_k_logprobs_are_the_renormalized_distribution(ckpt, oracle, device, dtype):
    if dtype == "bfloat16":
        pytest.skip("the renormalized support is compared exactly: fp32 only")
    eng = engine(ckpt, "static", device, dtype)
    top_p, top_k, temperature = 0.6, 6, 1.3
    rows = [
        row(
            p,
            seed=1 + i,
            max_new_tokens=10,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            ignore_eos=True,
        )
        for i, p in enumerate(PROMPTS)
    ]
    for r, res in zip(rows, eng.generate(rows, Gate()), strict=True):
        full = oracle_logp(oracle, list(r.prompt_ids) + res.output_ids, temperature).exp().double()
        for t, (lp, tok) in enumerate(zip(res.output_logprobs, res.output_ids, strict=True)):
            p = full[len(r.prompt_ids) - 1 + t]
            kept, before = [], 0.0
            for rank, v in enumerate(p.argsort(descending=True).tolist()):  # SGLang's top-p rule
                if rank >= top_k or (rank > 0 and before > top_p):
                    break
                kept.append(v)
                before += float(p[v])
            assert tok in kept
            assert abs(lp - float(torch.log(p[tok] / p[kept].sum()))) < (
                TOL if device == "cpu" else CUDA_FP32_TOL
            )


def test_static_row_is_the_same_alone_and_in_any_batch(ckpt):
    eng = engine(ckpt, "static")
    target = row(PROMPTS[0], seed=11, max_new_tokens=20, temperature=0.9, ignore_eos=True)
    alone = eng.generate([target], Gate())[0]
    others = [
        row(PROMPTS[2], seed=5, max_new_tokens=70, temperature=1.0, ignore_eos=True),  # wider cache
        row(PROMPTS[1], seed=11, max_new_tokens=3, temperature=0.5, top_p=0.8),
        row(tuple(range(1, 30)), seed=2, max_new_tokens=8, temperature=0.0),  # another prompt bucket
    ]
    for batch, at in (([*others, target], 3), ([target, *others[:1]], 0), ([others[1], target], 1)):
        res = eng.generate(batch, Gate())[at]
        assert res.output_ids == alone.output_ids and res.finish == alone.finish
        diff = (torch.tensor(res.output_logprobs) - torch.tensor(alone.output_logprobs)).abs().max()
        assert diff <= TOL
    again = eng.generate([target], Gate())[0]
    assert again.output_ids == alone.output_ids and again.output_logprobs == alone.output_logprobs
    other_seed = eng.generate(
        [row(PROMPTS[0], seed=12, max_new_tokens=20, temperature=0.9, ignore_eos=True)], Gate()
    )
    assert other_seed[0].output_ids != alone.output_ids


def greedy_rows(free_ids: list[int]) -> list[RowRequest]:
    """Greedy rows over stop ids, eos, ignore_eos and max_new_tokens 0..40 (past the 16-step poll)."""
    stop = free_ids[5]
    return [
        row(PROMPTS[2], max_new_tokens=40, temperature=0.0, ignore_eos=True),
        row(PROMPTS[2], max_new_tokens=40, temperature=0.0, stop_token_ids=[stop]),
        row(PROMPTS[2], max_new_tokens=40, temperature=0.0),  # eos (set by the test) ends it
        row(PROMPTS[0], max_new_tokens=0, temperature=0.0),
        row(PROMPTS[1], max_new_tokens=3, temperature=0.0, ignore_eos=True),
        row(PROMPTS[3], max_new_tokens=17, temperature=0.0, top_k=1),
        RowRequest(
            PROMPTS[0], SamplingParams(max_new_tokens=5, temperature=0.0), seed=0, return_logprob=False
        ),
    ]


def assert_same(a, b) -> None:
    assert a.output_ids == b.output_ids and a.finish == b.finish and a.weight_version == b.weight_version
    assert len(a.output_logprobs) == len(b.output_logprobs)
    if a.output_logprobs:
        assert (torch.tensor(a.output_logprobs) - torch.tensor(b.output_logprobs)).abs().max() <= TOL


def test_static_stops_lengths_and_finish_reasons_are_the_loops(ckpt):
    loop, static = engine(ckpt, "loop"), engine(ckpt, "static")
    free = loop.generate([row(PROMPTS[2], max_new_tokens=40, temperature=0.0, ignore_eos=True)], Gate())[0]
    eos = free.output_ids[9]
    loop.eos_token_ids = static.eos_token_ids = frozenset({eos})
    rows = greedy_rows(free.output_ids)
    expected, got = loop.generate(rows, Gate()), static.generate(rows, Gate())
    for a, b in zip(expected, got, strict=True):
        assert_same(b, a)
    assert got[1].finish["type"] == "stop" and got[2].finish == {"type": "stop", "matched": eos}
    assert got[0].finish == {"type": "length", "length": 40} and len(got[0].output_ids) == 40
    assert got[3].output_ids == [] and got[3].finish == {"type": "length", "length": 0}
    assert got[6].output_logprobs == [] and len(got[6].output_ids) <= 5
    early, gate = rows[1:3], Gate()  # every row stops by step 10: the host notices at the 16-step poll
    for a, b in zip(loop.generate(early, Gate()), static.generate(early, gate), strict=True):
        assert_same(b, a)
    assert gate.calls == 16
    zero = static.generate([rows[3]], Gate(abort_at=0))[0]  # no step: the gate is never asked
    assert zero.finish == {"type": "length", "length": 0}


@pytest.mark.parametrize("abort_at", [0, 4, 25])
def test_static_abort_between_steps_is_the_loops(ckpt, abort_at):
    loop, static = engine(ckpt, "loop"), engine(ckpt, "static")
    rows = [
        row(PROMPTS[2], max_new_tokens=40, temperature=0.0, ignore_eos=True),
        row(PROMPTS[1], max_new_tokens=3, temperature=0.0, ignore_eos=True),
    ]
    expected, got = loop.generate(rows, Gate(abort_at)), static.generate(rows, Gate(abort_at))
    for a, b in zip(expected, got, strict=True):
        assert_same(b, a)
    assert got[0].finish == {"type": "abort", "message": "aborted by /pause_generation"}
    assert len(got[0].output_ids) == abort_at
    assert got[1].finish["type"] == ("abort" if abort_at < 3 else "length")


def test_static_weights_change_between_steps_as_the_loop(ckpt, ckpt_other):
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(ckpt_other, dtype=torch.float32).state_dict()
    rows = [
        row(PROMPTS[2], max_new_tokens=30, temperature=0.0, ignore_eos=True),
        row(PROMPTS[0], max_new_tokens=30, temperature=0.0, ignore_eos=True),
    ]
    outs = {}
    for decoder in ("loop", "static"):
        eng = engine(ckpt, decoder)
        before = eng.generate(rows, Gate())

        def swap(k, eng=eng):
            if k == 10:
                eng.load_named_tensors(other, "v2")

        outs[decoder] = eng.generate(rows, Gate(on_step=swap))
        assert all(r.weight_version == "v2" for r in outs[decoder])
        assert outs[decoder][0].output_ids[:10] == before[0].output_ids[:10]
        assert outs[decoder][0].output_ids != before[0].output_ids
    for a, b in zip(outs["loop"], outs["static"], strict=True):
        assert_same(b, a)


def test_static_engine_runs_input_logprob_rows_on_the_loop(ckpt):
    loop, static = engine(ckpt, "loop"), engine(ckpt, "static")
    rows = [
        RowRequest(
            PROMPTS[2],
            SamplingParams(max_new_tokens=6, temperature=0.8),
            seed=4,
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=2,
        )
    ]
    a, b = loop.generate(rows, Gate())[0], static.generate(rows, Gate())[0]
    # the loop's draws (the static decoder's counter hash gives others); the static engine's model runs the
    # grouped one-token attention, equal up to float rounding
    assert a.output_ids == b.output_ids and [i for _, i in sum(a.output_top, [])] == [
        i for _, i in sum(b.output_top, [])
    ]
    for x, y in ((a.output_logprobs, b.output_logprobs), (a.input_logprobs[1:], b.input_logprobs[1:])):
        assert (torch.tensor(x) - torch.tensor(y)).abs().max() <= TOL
    assert a.input_logprobs[0] is None and b.input_logprobs[0] is None


def test_auto_decoder_is_by_device_and_unknown_is_refused(ckpt):
    assert engine(ckpt, "auto").decoder == "loop"
    with pytest.raises(ValueError, match="decoder='fast'"):
        engine(ckpt, "fast")


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2**32
    return x ^ (x >> 16)


def test_counter_uniforms_are_the_documented_hash():
    seeds = [0, 1, 7, 2**31 + 5, 2**40 + 3, 2**64 - 1, -5]
    keys = counter_rng.row_keys(seeds, torch.device("cpu"))
    for step in (0, 1, 1000, 2**33):
        got = counter_rng.uniforms(keys, step).tolist()
        for seed, u in zip(seeds, got, strict=True):
            s = seed % 2**64
            key = _lowbias32((s % 2**32) ^ _lowbias32((s >> 32) ^ 0x9E3779B9))
            bits = _lowbias32(_lowbias32((key + step * 0x9E3779B9) % 2**32) ^ key)
            assert u == (bits >> 8) / 2**24
    many = counter_rng.uniforms(counter_rng.row_keys(list(range(20000)), torch.device("cpu")), 3)
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float(many.std()) - 12**-0.5) < 0.01


def test_compile_decode_is_refused_off_cuda(ckpt):
    with pytest.raises(ValueError, match="compile_decode=True needs the static decoder on CUDA"):
        HFRolloutEngine.load(str(ckpt), "cpu", "float32", decoder="static", compile_decode=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_compiled_decode_logprobs_equal_direct_forward(ckpt, oracle, temperature):
    eng = HFRolloutEngine.load(str(ckpt), "cuda", "float32", decoder="static", compile_decode=True)
    rows = [
        row(p, seed=3 + i, max_new_tokens=24, temperature=temperature, ignore_eos=True)
        for i, p in enumerate(PROMPTS)
    ]
    for _ in range(2):  # the second batch reuses the kept cache and the captured graphs
        results = eng.generate(rows, Gate())
        assert eng.compile_active, "the compiled decode forward fell back to eager (see the log)"
        for r, res in zip(rows, results, strict=True):
            ref = oracle_logp(oracle, list(r.prompt_ids) + res.output_ids, temperature)
            n = len(r.prompt_ids)
            expected = torch.tensor([float(ref[n - 1 + t, tok]) for t, tok in enumerate(res.output_ids)])
            assert (torch.tensor(res.output_logprobs) - expected).abs().max() <= CUDA_FP32_TOL


def test_static_full_width_masks_equal_written_only(ckpt):
    """The CUDA-graph layout (every step attends over all C slots) decodes as the eager one (written slots)."""
    from transformers import StaticCache

    from mopd_hpc.engines.rollout.static_decoder import StaticRow, cache_length, decode_static, kv_view

    eng = engine(ckpt, "static")
    srows = [
        StaticRow(p, 0.8, 1.0, -1, 20 + 5 * i, frozenset(), seed=i) for i, p in enumerate(PROMPTS)
    ]  # fmt: skip
    outs = []
    for written_only in (False, True):
        cache = StaticCache(config=eng.model.config, max_cache_len=cache_length(srows)[1])
        forward, span = eng._forward_static, None
        if written_only:
            set_end = kv_view(cache)
            assert set_end is not None

            def forward(ids, mask4d, pos, cache, cache_position, set_end=set_end):
                set_end(mask4d.shape[-1])
                return eng._forward_static(ids, mask4d, pos, cache, cache_position)

            def span(written):
                return written

        outs.append(decode_static(srows, forward, cache, Gate(), eng.device, eng._static_mask(), span))
    for a, b in zip(*outs, strict=True):
        assert a.output_ids == b.output_ids and a.finish == b.finish
        assert (torch.tensor(a.output_logprobs) - torch.tensor(b.output_logprobs)).abs().max() <= TOL


def test_static_on_eager_attention_equals_sdpa(ckpt):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    eager = HFRolloutEngine(model, str(ckpt), torch.device("cpu"), torch.float32, decoder="static")
    rows = [
        row(p, seed=i, max_new_tokens=20, temperature=0.9, ignore_eos=True) for i, p in enumerate(PROMPTS)
    ]
    for a, b in zip(eager.generate(rows, Gate()), engine(ckpt, "static").generate(rows, Gate()), strict=True):
        assert_same(a, b)


def test_static_engine_switches_sdpa_to_grouped_and_decodes_as_plain_sdpa(ckpt):
    """The static decoder's engine runs `grouped_attention.py`; the static decoder on transformers' own SDPA
    (an engine built as "loop", then set to "static") is the oracle. Loop engines and eager models keep
    their attention."""
    from transformers import AutoModelForCausalLM

    from mopd_hpc.engines.rollout.grouped_attention import NAME, use_grouped_attention

    grouped = engine(ckpt, "static")
    assert grouped.grouped_attention and grouped.model.config._attn_implementation == NAME
    loop = engine(ckpt, "loop")
    assert not loop.grouped_attention and loop.model.config._attn_implementation == "sdpa"
    loop.decoder = "static"
    rows = [
        row(p, seed=i, max_new_tokens=16, temperature=0.9, ignore_eos=True) for i, p in enumerate(PROMPTS)
    ]
    for a, b in zip(grouped.generate(rows, Gate()), loop.generate(rows, Gate()), strict=True):
        assert_same(a, b)
    eager = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager")
    assert not use_grouped_attention(eager) and eager.config._attn_implementation == "eager"


def test_failed_compiled_forward_falls_back_to_eager_with_the_same_result(ckpt, caplog):
    """A compiled call that fails midway (here after advancing the cache's write offsets, as a failed CUDA-graph
    recording may) is logged and redone eagerly; the batch decodes as the eager static decoder does."""
    eng = engine(ckpt, "static")
    rows = [
        row(p, seed=i, max_new_tokens=20, temperature=0.9, ignore_eos=True) for i, p in enumerate(PROMPTS)
    ]
    expected = eng.generate(rows, Gate())

    def failing(**kwargs):
        for layer in kwargs[eng._cache_kw].layers:
            layer.cumulative_length.add_(1)
        raise RuntimeError("capture failed (test)")

    eng.compile_decode, eng._compiled = True, failing  # as if torch.compile had returned `failing`
    with caplog.at_level("ERROR"):
        got = eng.generate(rows, Gate())
    assert "compiled decode forward failed" in caplog.text
    assert not eng.compile_decode and not eng.compile_active
    for a, b in zip(got, expected, strict=True):
        assert_same(a, b)


def test_padded_batch_decodes_as_the_unpadded_one(ckpt):
    """The compiled decoder's fixed shape (graph_shape): rows that decode nothing and extra cache slots leave
    the real rows' tokens, finish reasons and log-probs as they were."""
    from transformers import StaticCache

    from mopd_hpc.engines.rollout.graph_shape import graph_length
    from mopd_hpc.engines.rollout.static_decoder import StaticRow, cache_length, decode_static, padding_rows

    eng = engine(ckpt, "static")
    srows = [
        StaticRow(p, 0.8, 1.0, -1, 20 + 5 * i, frozenset({7}) if i == 1 else frozenset(), seed=i)
        for i, p in enumerate(PROMPTS)
    ]  # fmt: skip
    outs = []
    for padded in (False, True):
        rows = srows + padding_rows(5) if padded else srows
        length = graph_length(64, 200) if padded else 0
        assert cache_length(rows, length)[1] == (320 if padded else 64 + 64)
        cache = StaticCache(config=eng.model.config, max_cache_len=cache_length(rows, length)[1])
        got = decode_static(
            rows, eng._forward_static, cache, Gate(), eng.device, eng._static_mask(), None, length
        )
        assert len(got) == len(rows)
        if padded:
            assert all(o.output_ids == [] and o.finish == {"type": "length", "length": 0} for o in got[4:])
        outs.append(got[: len(srows)])
    for a, b in zip(*outs, strict=True):
        assert a.output_ids == b.output_ids and a.finish == b.finish
        assert (torch.tensor(a.output_logprobs) - torch.tensor(b.output_logprobs)).abs().max() <= TOL


def test_graph_shape_is_refused_below_one(ckpt):
    model = engine(ckpt, "static").model
    with pytest.raises(ValueError, match=r"graph_shape=\(0, 64\)"):
        HFRolloutEngine(model, str(ckpt), torch.device("cpu"), torch.float32, graph_shape=(0, 64))


def test_compile_decode_defaults_to_cuda_only(ckpt):
    assert engine(ckpt, "auto").compile_decode is False  # CPU: the loop decoder, eager


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_graph_shape_survives_release_offload_and_weight_update(ckpt, oracle, ckpt_other):
    """As the rollout server and an AWEX colocate sync drive it: batches of 4 and 2 rows padded to one (6 rows,
    192 slots) shape, `release_cache` after each batch (the compiled decoder keeps its cache); between the
    second and third batch the weights are released (generation refused), the other checkpoint's weights are
    copied in and they are resumed, as a sync does. The parameters keep their addresses throughout (the
    graphs hold them); every batch's μ equals the direct forward of the weights it ran with (the update is
    seen by the graph replays), the compiled path stays active, the one cache serves every batch."""
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(ckpt_other, dtype=torch.float32).eval()
    eng = HFRolloutEngine.load(str(ckpt), "cuda", "float32", graph_shape=(6, 192))
    assert eng.decoder == "static" and eng.compile_decode
    addresses = [p.data_ptr() for p in eng.model.parameters()]
    batches = [PROMPTS, PROMPTS[:2], PROMPTS, PROMPTS[1:3]]
    for k, prompts in enumerate(batches):
        if k == 2:
            eng.offload_weights()
            with pytest.raises(RuntimeError, match="released"):
                eng.generate([row(PROMPTS[0], max_new_tokens=2)], Gate())
            eng.onload_weights()
            eng.load_named_tensors(other.state_dict(), "1")
        rows = [
            row(p, seed=10 * k + i, max_new_tokens=24, temperature=0.7, ignore_eos=True)
            for i, p in enumerate(prompts)
        ]
        results = eng.generate(rows, Gate())
        eng.release_cache()
        assert eng.compile_active, "the compiled decode forward fell back to eager (see the log)"
        assert [p.data_ptr() for p in eng.model.parameters()] == addresses
        assert eng._kept_cache is not None and eng._kept_cache[0] == (6, 192)
        if k == 0:
            first_cache = eng._kept_cache[1]
        assert eng._kept_cache[1] is first_cache
        assert len(results) == len(rows)
        for r, res in zip(rows, results, strict=True):
            assert len(res.output_ids) == 24
            ref = oracle_logp(oracle if k < 2 else other, list(r.prompt_ids) + res.output_ids, 0.7)
            n = len(r.prompt_ids)
            expected = torch.tensor([float(ref[n - 1 + t, tok]) for t, tok in enumerate(res.output_ids)])
            assert (torch.tensor(res.output_logprobs) - expected).abs().max() <= CUDA_FP32_TOL, k
