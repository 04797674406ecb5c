"""The static decoder attending over spans of written slots (issue 35; `graph_shape.attention_span`), on real
micro Qwen3 checkpoints and, on CUDA, a random Qwen3-0.6B in bf16.

Oracles: the layout before issue 35 (every step attends over all C cache slots, attention_spans=1) and the
eager written-slots layout (`static_decoder.kv_view`): tokens and finish reasons equal, log μ within float
rounding (float64: 1e-12; float32: test_hf_decoder.TOL); a cache whose slots beyond each step's span hold
NaN (unread slots cannot change a result); on CUDA a direct bf16 forward of the same checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from helpers_models import QWEN3_0_6B, save_micro_qwen3
from test_hf_decoder import CUDA_BF16_TOL, PROMPTS, TOL, Gate, assert_same, oracle_logp, row

from mopd_hpc.engines.rollout.graph_shape import SPAN_ALIGN, attention_span, graph_length, span_step
from mopd_hpc.engines.rollout.hf_engine import HFRolloutEngine

F64_TOL = 1e-12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_micro_qwen3(tmp_path_factory.mktemp("spans") / "model", seed=0, initializer_range=0.2)


def test_attention_span_rule():
    assert span_step(1088) == 144 and attention_span(65, 128, 4) == 96 and attention_span(97, 128, 4) == 128
    for length in (64, 128, 320, 1088):
        for spans in (1, 3, 8):
            seen = {attention_span(n, length, spans) for n in range(1, length + 1)}
            assert all(s == length or s % SPAN_ALIGN == 0 for s in seen) and len(seen) <= spans
            assert all(n <= attention_span(n, length, spans) <= length for n in range(1, length + 1))
            if spans == 1:
                assert seen == {length}
    with pytest.raises(ValueError, match="spans=0"):
        span_step(128, 0)


def static_engine(ckpt, dtype: torch.dtype, spans: int | None) -> HFRolloutEngine:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()
    return HFRolloutEngine(
        model, str(ckpt), torch.device("cpu"), dtype, decoder="static", attention_spans=spans
    )


def mixed_rows():
    """Prompts of 1-6 tokens, sampled and greedy rows, a stop id, max_new_tokens 0..40: at 4 spans of the
    128-slot cache the steps cross from the 96-slot span to the 128-slot one at step 32."""
    return [
        row(PROMPTS[0], seed=1, max_new_tokens=40, temperature=0.9, ignore_eos=True),
        row(PROMPTS[1], seed=2, max_new_tokens=40, temperature=0.9, stop_token_ids=[5]),
        row(PROMPTS[2], seed=3, max_new_tokens=36, temperature=0.0, ignore_eos=True),
        row(PROMPTS[3], seed=4, max_new_tokens=0, temperature=0.9),
        row(PROMPTS[3], seed=5, max_new_tokens=33, temperature=1.2, top_p=0.8, ignore_eos=True),
    ]


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float64, F64_TOL), (torch.float32, TOL)], ids=["f64", "f32"]
)
def test_spans_decode_as_all_slots_and_as_the_written_slots(ckpt, dtype, tol):
    """The engine with 4 spans decodes as with all C slots (today's compiled layout) and as the eager
    written-slots layout; its masks are 64 (prefill), then 96 for steps 0-31, then 128."""
    rows = mixed_rows()
    spans = static_engine(ckpt, dtype, 4)
    widths = []
    forward = spans._forward_static

    def recording(ids, mask4d, *args):
        widths.append(mask4d.shape[-1])
        return forward(ids, mask4d, *args)

    spans._forward_static = recording
    got = spans.generate(rows, Gate())
    assert widths == [64] + [96] * 32 + [128] * 7
    assert [len(r.output_ids) for r in got][2:] == [36, 0, 33]
    for other in (static_engine(ckpt, dtype, 1), static_engine(ckpt, dtype, None)):
        for a, b in zip(got, other.generate(rows, Gate()), strict=True):
            assert_same(a, b)
            if a.output_logprobs:
                assert (torch.tensor(a.output_logprobs) - torch.tensor(b.output_logprobs)).abs().max() <= tol


def test_slots_beyond_the_span_are_not_read_in_a_padded_graph_shape(ckpt):
    """The compiled engine's fixed shape (padding rows, a 320-slot cache, 4 spans of 80) with every slot beyond
    the step's span set to NaN before each forward (and set back to the reset cache's zeros, unwritten, when
    a step's span reaches it): the real rows decode exactly as without the NaNs, and as the unpadded batch
    over all its slots (float64, within rounding)."""
    from transformers import StaticCache

    from mopd_hpc.engines.rollout.static_decoder import StaticRow, cache_length, decode_static, padding_rows

    eng = static_engine(ckpt, torch.float64, None)
    srows = [
        StaticRow(p, 0.8, 1.0, -1, 40 - 3 * i, frozenset({7}) if i == 1 else frozenset(), seed=i)
        for i, p in enumerate(PROMPTS)
    ]  # fmt: skip
    length = graph_length(64, 200)

    def span(written: int) -> int:
        return attention_span(written, length, 4)

    def decode(rows, length, span, poison):
        cache = StaticCache(config=eng.model.config, max_cache_len=cache_length(rows, length)[1])
        before = [0]  # the last forward's span

        def forward(ids, mask4d, pos, cache, cache_position):
            end = mask4d.shape[-1]
            with torch.inference_mode():
                for layer in cache.layers if poison and before[0] else ():
                    for kv in (layer.keys, layer.values):
                        kv[:, :, before[0] : end] = 0.0
                        kv[:, :, end:] = float("nan")
            before[0] = end
            return eng._forward_static(ids, mask4d, pos, cache, cache_position)

        return decode_static(rows, forward, cache, Gate(), eng.device, eng._static_mask(), span, length)

    padded = srows + padding_rows(4)
    clean = decode(padded, length, span, poison=False)[: len(srows)]
    poisoned = decode(padded, length, span, poison=True)[: len(srows)]
    assert poisoned == clean
    assert [len(o.output_ids) for o in clean][2:] == [34, 31]
    for a, b in zip(clean, decode(srows, 0, None, poison=False), strict=True):
        assert a.output_ids == b.output_ids and a.finish == b.finish
        assert (torch.tensor(a.output_logprobs) - torch.tensor(b.output_logprobs)).abs().max() <= F64_TOL


def test_attention_spans_below_one_are_refused(ckpt):
    with pytest.raises(ValueError, match="attention_spans=0"):
        static_engine(ckpt, torch.float32, 0)


def test_dynamo_traces_the_decode_step_once_per_span(ckpt):
    """The compiled path's tracing on CPU: torch.compile (dynamic=False, a backend that counts the graphs it
    is given and runs them as traced) over the engine's model, as `_compiled_forward` calls it; 4 spans of a
    128-slot cache give one graph per span the steps reach (96 and 128; the prefill is eager), and the
    batch decodes as the eager engine does."""
    rows = [
        row(p, seed=i, max_new_tokens=40, temperature=0.9, ignore_eos=True) for i, p in enumerate(PROMPTS)
    ]
    expected = static_engine(ckpt, torch.float32, 4).generate(rows, Gate())
    eng = static_engine(ckpt, torch.float32, 4)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    eng.compile_decode, eng._compiled = True, torch.compile(eng.model, backend=counting, dynamic=False)
    got = eng.generate(rows, Gate())
    assert eng.compile_active and len(graphs) == 2
    assert sorted(shape[-1] for shape in eng._compiled_calls) == [96, 128]
    for a, b in zip(got, expected, strict=True):
        assert_same(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_spans_logprobs_equal_direct_forward_cuda_bf16_0_6b(tmp_path):
    """The compiled decode step over 3 spans (96, 192, 256 slots of a (6 rows, 256 slots) graph shape), bf16,
    on a random Qwen3-0.6B: μ of every sampled token, at T = 0 and 0.7, within CUDA_BF16_TOL of a direct bf16
    forward; steps cross both span boundaries; one compilation per span, replayed by every later batch."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(**QWEN3_0_6B, max_position_embeddings=40960, rope_theta=1_000_000.0)
    with torch.device("cuda"):
        Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(tmp_path))
    eng = HFRolloutEngine.load(str(tmp_path), "cuda", "bfloat16", graph_shape=(6, 256), attention_spans=3)
    assert eng.compile_decode and eng.grouped_attention
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).to("cuda").eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 40, 64)]
    for temperature in (0.0, 0.7):
        worst = 0.0
        for batch in range(2):
            rows = [
                row(
                    p,
                    seed=10 * batch + i,
                    max_new_tokens=150 - 10 * i,
                    temperature=temperature,
                    ignore_eos=True,
                )
                for i, p in enumerate(prompts)
            ]
            results = eng.generate(rows, Gate())
            assert eng.compile_active, "the compiled decode forward fell back to eager (see the log)"
            for r, res in zip(rows, results, strict=True):
                assert len(res.output_ids) == r.sampling.max_new_tokens
                ref = oracle_logp(ref_model, list(r.prompt_ids) + res.output_ids, temperature, "cuda")
                n = len(r.prompt_ids)
                expected = torch.tensor([float(ref[n - 1 + t, tok]) for t, tok in enumerate(res.output_ids)])
                worst = max(worst, float((torch.tensor(res.output_logprobs) - expected).abs().max()))
        print(f"compiled spans, bf16 0.6B, T={temperature}: largest |Δ log μ| {worst:.4f} nats")
        assert worst <= CUDA_BF16_TOL
    assert sorted({shape[-1] for shape in eng._compiled_calls}) == [96, 192, 256]
