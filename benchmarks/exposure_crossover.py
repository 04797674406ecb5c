"""Exposure bias on long answers with partial credit: where on-policy distillation should beat SFT (issue 37).

    python benchmarks/exposure_crossover.py [--device cuda|cpu] [--steps 600] [--eval-every 50]
        [--lrs 1e-3,3e-3] [--methods sft,onpolicy,recipe] [--budget-s 480] [--out-dir benchmarks/results] [--quick]

Task: reasoning-gym `spell_backward` (words of 5-10 lowercase letters), character tokens
(`mopd_hpc.data.tokenizer`): prompt `<bos> word =`, answer `reversed word <eos>`. The training words come from
the dataset at `--seed`, the 500 held-out words from seed + 1000003 (disjoint from the training words). A tiny Qwen3
teacher (hidden 256, 4 layers) is trained by cross-entropy on ground truth until its held-out greedy exact match
reaches `--teacher-target`; a capacity-limited student (hidden 64, 2 layers) is warmed up briefly on ground
truth, and every method starts from exactly that state, with the same prompt stream, batch, AdamW and lr
schedule (linear warm-up, cosine to 10 %), for each lr of `--lrs`:

    sft       cross-entropy on the teacher's greedy answers to the step's prompts (cut after its EOS)
    onpolicy  the student samples at temperature 1; loss = exact reverse KL(π_student ‖ π_teacher) over the
              whole 45-token vocabulary at each response position up to and including the student's EOS,
              token-mean: the project's `mopd_hpc.mopd.topk.topk_reverse_kl_loss` with k = vocabulary
              (its truncation correction is then zero), teacher under no_grad
    recipe    sft for the first half of the steps, then onpolicy

Every `--eval-every` steps: the student's greedy exact match and mean partial credit (reasoning-gym's
`score_answer`: share of positions right, counted from the start) on the held-out words, plus the derailment
diagnostics of its wrong answers: `after_err` (mean share of the gold positions after the first wrong character
that are right), `derail` (share of wrong answers with under half of those right), `shifted` (share of wrong
answers whose tail after the first error is mostly the gold tail shifted by one: a skipped or repeated letter
followed by correct copying) and `lev` (mean max(0, 1 - edit distance / length)). Per point also the steps, the student
tokens trained on and the training wall seconds (evaluations excluded, CUDA synchronized).

How to read it: a crossover is where `onpolicy` (or `recipe`) reaches a higher partial credit / exact match than
`sft` at equal steps or tokens. The exposure-bias story predicts SFT answers that derail after their first
mistake (high `derail`, low `after_err`) and on-policy answers that recover. Writes OUT_DIR/
exposure_crossover.json (config, device, teacher accuracy, every setting's curve, the best lr per method) and
OUT_DIR/exposure_crossover.png (exact match and partial credit against steps, the best lr per method solid).
`--budget-s` bounds the whole run: settings that would start after it are skipped and recorded as such.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import mopd_hpc.data.tokenizer as chartok

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy_plot import figure, save  # noqa: E402
from results_file import write_results  # noqa: E402

BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, CHARSET = (
    chartok.BOS_ID,
    chartok.EOS_ID,
    chartok.PAD_ID,
    chartok.VOCAB_SIZE,
    chartok.CHARSET,
)
P_LEN, A_LEN = 12, 11  # prompt `<bos> word(≤10) =`, answer `reversed(≤10) <eos>`
#: item i of the dataset at seed s draws with Random(s + i): seeds s and s+1 share all but one item
EVAL_SEED = 1_000_003


def qwen3(hidden: int, layers: int, heads: int, seed: int) -> Any:
    """A fresh Qwen3ForCausalLM shaped like tools/build_tiny_models.py's `qwen3_config` (eager attention:
    the left-padded rows stay finite)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=chartok.MODEL_MAX_LENGTH,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg)


def load_words(seed: int, n_train: int, n_eval: int) -> tuple[list[str], list[dict[str, Any]], Any]:
    """Unique training words (dataset at `seed`), held-out entries (seed + EVAL_SEED, words not in training), the
    eval dataset (its `score_answer`)."""
    import reasoning_gym

    ok = set(CHARSET)
    kw = {"min_word_len": 5, "max_word_len": 10}
    tr = reasoning_gym.create_dataset("spell_backward", seed=seed, size=n_train, **kw)
    train = sorted({e["metadata"]["word"] for e in tr if set(e["metadata"]["word"]) <= ok})
    seen, evals = set(train), []
    ev = reasoning_gym.create_dataset("spell_backward", seed=seed + EVAL_SEED, size=4 * n_eval, **kw)
    for e in ev:
        w = e["metadata"]["word"]
        if set(w) <= ok and w not in seen and len(evals) < n_eval:
            seen.add(w)
            evals.append(e)
    return train, evals, ev


def encode(tok: Any, words: list[str], device: str) -> tuple[torch.Tensor, ...]:
    """prompt [N, P_LEN] left-padded, its mask, answer [N, A_LEN] right-padded (EOS then PAD), its mask."""
    ids = tok(words, add_special_tokens=False)["input_ids"]
    n = len(words)
    prompt, pmask = torch.full((n, P_LEN), PAD_ID), torch.zeros(n, P_LEN, dtype=torch.long)
    ans, amask = torch.full((n, A_LEN), PAD_ID), torch.zeros(n, A_LEN, dtype=torch.bool)
    eq = tok("=", add_special_tokens=False)["input_ids"][0]
    for i, w in enumerate(ids):
        p, a = [BOS_ID, *w, eq], [*w[::-1], EOS_ID]
        prompt[i, P_LEN - len(p) :], pmask[i, P_LEN - len(p) :] = torch.tensor(p), 1
        ans[i, : len(a)], amask[i, : len(a)] = torch.tensor(a), True
    return tuple(t.to(device) for t in (prompt, pmask, ans, amask))


def fwd(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits


@torch.no_grad()
def generate(
    model: Any,
    prompt: torch.Tensor,
    pmask: torch.Tensor,
    n_new: int,
    temp: float = 0.0,
    gen: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy (temp 0) or sampled response [B, n_new] (PAD after EOS) and its mask (up to and incl. EOS)."""
    was = model.training
    model.eval()
    seq, mask = prompt, pmask
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    out, live = [], []
    for _ in range(n_new):
        logits = fwd(model, seq, mask)[:, -1].float()
        if temp == 0.0:
            nxt = logits.argmax(-1)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temp, -1), 1, generator=gen).squeeze(-1)
        live.append(~done)
        nxt = torch.where(done, PAD_ID, nxt)
        out.append(nxt)
        done = done | (nxt == EOS_ID)
        seq, mask = torch.cat([seq, nxt[:, None]], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        if bool(done.all()):
            break
    resp, rmask = torch.stack(out, 1), torch.stack(live, 1)
    pad = n_new - resp.shape[1]
    model.train(was)
    return F.pad(resp, (0, pad), value=PAD_ID), F.pad(rmask, (0, pad), value=False)


def response_logits(model: Any, prompt, pmask, resp) -> torch.Tensor:  # noqa: ANN001
    """Logits [B, R, V] predicting each response token."""
    logits = fwd(model, torch.cat([prompt, resp], 1), torch.cat([pmask, torch.ones_like(resp)], 1))
    return logits[:, P_LEN - 1 : P_LEN - 1 + resp.shape[1]].float()


def ce_loss(model: Any, prompt, pmask, resp, rmask) -> torch.Tensor:  # noqa: ANN001
    logits = response_logits(model, prompt, pmask, resp)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), resp.reshape(-1), reduction="none")
    return (ce.view_as(rmask.float()) * rmask).sum() / rmask.sum().clamp(min=1)


def rkl_loss(student: Any, teacher: Any, prompt, pmask, resp, rmask) -> torch.Tensor:  # noqa: ANN001
    """Exact per-token reverse KL over the vocabulary via the project's topk estimator (k = V), token-mean."""
    from mopd_hpc.config.loss import LossConfig
    from mopd_hpc.mopd.topk import TeacherTopK, topk_reverse_kl_loss

    with torch.no_grad():
        t_logits = response_logits(teacher, prompt, pmask, resp)
    s_logits = response_logits(student, prompt, pmask, resp)
    top = {"t": TeacherTopK.from_logits(t_logits, VOCAB_SIZE)}
    ones = {"t": torch.ones(resp.shape[0], device=resp.device)}
    cfg = LossConfig(estimator="topk", topk=VOCAB_SIZE, normalizer="token-mean")
    return topk_reverse_kl_loss(s_logits, top, ones, rmask, cfg)[0]


def decode(resp: torch.Tensor) -> list[str]:
    """Characters up to the first EOS; any other special token reads as '?' (never right)."""
    out = []
    for row in resp.tolist():
        row = row[: row.index(EOS_ID)] if EOS_ID in row else row
        out.append("".join(CHARSET[t - 4] if t >= 4 else "?" for t in row))
    return out


def lev(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def evaluate(model: Any, tok: Any, data: dict[str, Any]) -> dict[str, float]:
    resp, _ = generate(model, data["prompt"], data["pmask"], A_LEN + 2)
    preds, ds = decode(resp), data["ds"]
    em = pc = ev = 0.0
    after, derail, shifted, wrong = [], 0, 0, 0
    for p, e in zip(preds, data["entries"], strict=True):
        g = e["answer"]
        em += p == g
        pc += ds.score_answer(p, e)
        ev += max(0.0, 1 - lev(p, g) / len(g))
        if p == g:
            continue
        wrong += 1
        i = next((k for k in range(len(g)) if k >= len(p) or p[k] != g[k]), len(g))
        tail = range(i + 1, len(g))
        if len(tail) == 0:
            continue
        right = sum(j < len(p) and p[j] == g[j] for j in tail) / len(tail)
        after.append(right)
        derail += right < 0.5
        skip = sum(j - 1 < len(p) and p[j - 1] == g[j] for j in tail) / len(tail)  # gold letter i skipped
        rep = sum(j + 1 < len(p) and p[j + 1] == g[j] for j in range(i, len(g))) / (
            len(g) - i
        )  # one inserted
        shifted += max(skip, rep) >= 0.5
    n = len(preds)
    return {
        "exact": em / n,
        "partial": pc / n,
        "lev": ev / n,
        "wrong": wrong,
        "after_err": sum(after) / max(1, len(after)),
        "derail": derail / max(1, wrong),
        "shifted": shifted / max(1, wrong),
        "examples": [f"{e['answer']}->{p}" for p, e in zip(preds[:6], data["entries"][:6], strict=True)],
    }


def lr_factor(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def train_gt(
    model: Any,
    train: tuple[torch.Tensor, ...],
    steps: int,
    batch: int,
    lr: float,
    seed: int,
    check: Any = None,
    every: int = 0,
) -> int:
    """Cross-entropy on ground truth; stops early when `check()` (called every `every` steps) says so."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    g = torch.Generator(device="cpu").manual_seed(seed)
    model.train()
    for step in range(steps):
        for grp in opt.param_groups:
            grp["lr"] = lr * lr_factor(step, steps, 50)
        idx = torch.randint(train[0].shape[0], (batch,), generator=g).to(train[0].device)
        loss = ce_loss(model, *(t[idx] for t in train))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if check is not None and every and (step + 1) % every == 0 and check(step + 1):
            return step + 1
    return steps


def run_method(
    method: str,
    lr: float,
    args: argparse.Namespace,
    student0: dict,
    teacher: Any,
    train: tuple[torch.Tensor, ...],
    evald: dict,
    tok: Any,
    sargs: tuple,
) -> dict[str, Any]:
    student = qwen3(*sargs, seed=args.seed).to(args.device)
    student.load_state_dict(student0)
    student.train()
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator(device="cpu").manual_seed(args.seed + 100)  # the prompt stream: same for every run
    gs = torch.Generator(device=args.device).manual_seed(args.seed + 200)  # the student's samples
    tokens, secs, curve = 0, 0.0, [{"step": 0, "tokens": 0, "seconds": 0.0, **evaluate(student, tok, evald)}]
    for step in range(args.steps):
        torch.cuda.synchronize() if args.device == "cuda" else None
        t0 = time.perf_counter()
        for grp in opt.param_groups:
            grp["lr"] = lr * lr_factor(step, args.steps, 20)
        idx = torch.randint(train[0].shape[0], (args.batch,), generator=g).to(args.device)
        prompt, pmask = train[0][idx], train[1][idx]
        phase = "sft" if method == "sft" or (method == "recipe" and step < args.steps // 2) else "onpolicy"
        if phase == "sft":
            resp, rmask = generate(teacher, prompt, pmask, A_LEN + 2)
            loss = ce_loss(student, prompt, pmask, resp, rmask)
        else:
            resp, rmask = generate(student, prompt, pmask, A_LEN + 2, temp=1.0, gen=gs)
            loss = rkl_loss(student, teacher, prompt, pmask, resp, rmask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        tokens += int(rmask.sum())
        torch.cuda.synchronize() if args.device == "cuda" else None
        secs += time.perf_counter() - t0
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            pt = {"step": step + 1, "tokens": tokens, "seconds": round(secs, 2), "loss": loss.item()}
            curve.append({**pt, **evaluate(student, tok, evald)})
            c = curve[-1]
            print(
                f"  {method:8s} lr {lr:g} step {c['step']:4d} exact {c['exact']:.3f} partial {c['partial']:.3f}"
                f" derail {c['derail']:.2f} shifted {c['shifted']:.2f} loss {c['loss']:.4f} ({secs:.0f} s)",
                flush=True,
            )
    return {
        "method": method,
        "lr": lr,
        "curve": curve,
        "final": curve[-1],
        "steps": args.steps,
        "tokens": tokens,
        "train_seconds": round(secs, 2),
    }


def best_key(s: dict[str, Any]) -> tuple[float, float, float]:  # final partial, final exact, curve mean
    return s["final"]["partial"], s["final"]["exact"], sum(p["partial"] for p in s["curve"]) / len(s["curve"])


def plot(result: dict[str, Any], path: Path) -> None:
    fig, axes = figure(1, 2, (11, 4.2))
    colors = {"sft": "tab:blue", "onpolicy": "tab:red", "recipe": "tab:green"}
    for r in result["settings"]:
        best = result["best_lr"].get(r["method"]) == r["lr"]
        for ax, key in zip(axes[0], ("exact", "partial"), strict=True):
            xs, ys = [p["step"] for p in r["curve"]], [100 * p[key] for p in r["curve"]]
            ax.plot(
                xs,
                ys,
                color=colors[r["method"]],
                linestyle="-" if best else ":",
                alpha=1 if best else 0.5,
                label=f"{r['method']} lr {r['lr']:g}",
                marker="o" if best else None,
                markersize=3,
            )
    for ax, key in zip(axes[0], ("exact match %", "partial credit %"), strict=True):
        ax.axhline(100 * result["teacher"][key.split()[0]], color="black", linestyle="--", linewidth=0.8)
        ax.set(xlabel="student steps", ylabel=key, ylim=(0, 105))
        ax.grid(alpha=0.3)
    save(fig, axes, path, "spell_backward: SFT on teacher answers vs on-policy reverse KL (dashed: teacher)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lrs", default="1e-3,3e-3")
    ap.add_argument("--methods", default="sft,onpolicy,recipe")
    ap.add_argument("--teacher", default="256,4,8", help="hidden,layers,heads")
    ap.add_argument("--student", default="64,2,4", help="hidden,layers,heads")
    ap.add_argument("--teacher-steps", type=int, default=6000)
    ap.add_argument("--teacher-target", type=float, default=0.97)
    ap.add_argument("--warmup-steps", type=int, default=100, help="student warm-up on ground truth")
    ap.add_argument("--n-train", type=int, default=60000)
    ap.add_argument("--n-eval", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--quick", action="store_true", help="tiny everything (a smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.eval_every, args.batch, args.n_train, args.n_eval = 4, 2, 8, 200, 16
        args.teacher, args.student, args.teacher_steps, args.warmup_steps = "32,1,2", "16,1,2", 4, 2
    start = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    tok = chartok.build_char_tokenizer()
    words, entries, ds = load_words(args.seed, args.n_train, args.n_eval)
    train = encode(tok, words, args.device)
    ep, epm, _, _ = encode(tok, [e["metadata"]["word"] for e in entries], args.device)
    evald = {"prompt": ep, "pmask": epm, "entries": entries, "ds": ds}
    targs = tuple(int(x) for x in args.teacher.split(","))
    sargs = tuple(int(x) for x in args.student.split(","))
    print(f"{len(words)} training words, {len(entries)} held-out; device {args.device}", flush=True)

    teacher = qwen3(*targs, seed=args.seed).to(args.device)
    tlog: list[dict] = []

    def check(step: int) -> bool:
        r = evaluate(teacher, tok, evald)
        teacher.train()
        tlog.append({"step": step, "exact": r["exact"], "partial": r["partial"]})
        print(f"  teacher step {step} exact {r['exact']:.3f} ({time.perf_counter() - start:.0f} s)")
        return r["exact"] >= args.teacher_target or time.perf_counter() - start > 0.4 * args.budget_s

    t_steps = train_gt(teacher, train, args.teacher_steps, 256, 1e-3, args.seed + 1, check, 250)
    teacher.eval()
    t_eval = evaluate(teacher, tok, evald)
    print(f"teacher: {t_steps} steps, exact {t_eval['exact']:.3f} partial {t_eval['partial']:.3f}")

    student = qwen3(*sargs, seed=args.seed + 2).to(args.device)
    train_gt(student, train, args.warmup_steps, args.batch, 2e-3, args.seed + 3)
    student0 = {k: v.detach().clone() for k, v in student.state_dict().items()}
    s_eval = evaluate(student, tok, evald)
    print(f"student start: exact {s_eval['exact']:.3f} partial {s_eval['partial']:.3f}", flush=True)

    lrs, methods = [float(x) for x in args.lrs.split(",")], args.methods.split(",")
    settings, skipped = [], []
    # every method at the first lr before any at the second: a cut budget keeps a fair comparison
    for lr in lrs:
        for m in methods:
            if settings and time.perf_counter() - start + max(s["wall"] for s in settings) > args.budget_s:
                skipped.append({"method": m, "lr": lr})
                continue
            t0 = time.perf_counter()
            settings.append({**run_method(m, lr, args, student0, teacher, train, evald, tok, sargs)})
            settings[-1]["wall"] = time.perf_counter() - t0
    best: dict[str, float] = {}
    for m in methods:
        cands = [s for s in settings if s["method"] == m]
        if cands:
            best[m] = max(cands, key=best_key)["lr"]
    result = {
        "config": vars(args),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "teacher": {**t_eval, "steps": t_steps, "log": tlog, "shape": args.teacher},
        "student_start": s_eval,
        "settings": settings,
        "skipped": skipped,
        "best_lr": best,
        "total_seconds": round(time.perf_counter() - start, 1),
    }
    print(f"\nteacher exact {t_eval['exact']:.3f} partial {t_eval['partial']:.3f} ({t_steps} steps)")
    print(
        f"{'method':9s} {'lr':>6s} {'steps':>5s} {'tokens':>8s} {'sec':>6s} {'exact':>6s} {'partial':>7s} "
        f"{'lev':>5s} {'after':>5s} {'derail':>6s} {'shift':>5s}"
    )
    for s in settings:
        f = s["final"]
        print(
            f"{s['method']:9s} {s['lr']:6g} {s['steps']:5d} {s['tokens']:8d} {s['train_seconds']:6.1f} "
            f"{f['exact']:6.3f} {f['partial']:7.3f} {f['lev']:5.3f} {f['after_err']:5.2f} {f['derail']:6.2f} "
            f"{f['shifted']:5.2f}"
        )
    out = Path(args.out_dir)
    write_results(out / "exposure_crossover.json", result)
    plot(result, out / "exposure_crossover.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
