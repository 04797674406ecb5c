"""trainer/progress.py's plain line from metrics lines: an on-policy step, and an SFT warm-up step whose
`mopd/*` values are null in metrics.jsonl (`loss.sft_warmup_ratio`/`sft_warmup_steps`; the line once raised
on them and ended `mopd-submit --local` at step 1)."""

from __future__ import annotations

import io
import json

from mopd_hpc.trainer.progress import Progress, summary_line

MOPD = {"loss/total": 0.5, "mopd/reverse_kl": 1.25, "accuracy/chain": 0.5, "accuracy/legs": 0.25}
SFT = {"loss/total": 0.75, "loss/sft": 0.75, "loss/mopd": 0.0, "mopd/reverse_kl": None, "accuracy/chain": 1.0}


def test_an_on_policy_step_shows_its_reverse_kl():
    assert (
        summary_line(3, 10, MOPD, 0.5)
        == "step 3/10  loss 0.5000  kl 1.2500  acc chain 50%  legs 25%  0.50 s/step"
    )


def test_an_sft_step_shows_sft_in_place_of_the_null_kl():
    line = json.loads(json.dumps(SFT))  # as read back from metrics.jsonl: null → None
    assert summary_line(1, 10, line, 0.25) == "step 1/10  loss 0.7500  sft  acc chain 100%  0.25 s/step"
    out = io.StringIO()
    with Progress(out, 0, 2, every=1) as progress:
        progress.update(1, line, 0.25)
        progress.update(2, {**MOPD, "loss/total": None}, 0.5)
    assert out.getvalue().splitlines() == [
        "step 1/2  loss 0.7500  sft  acc chain 100%  0.25 s/step",
        "step 2/2  loss nan  kl 1.2500  acc chain 50%  legs 25%  0.50 s/step",
    ]
