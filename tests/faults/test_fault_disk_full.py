"""Fault: the disk fills up during a checkpoint write (a real tmpfs too small for a second checkpoint).

Kept: the save fails with OSError ENOSPC naming the file it was writing; `latest` still names the previous
checkpoint, which loads whole (its SHA-256 manifest checked); nothing half-written is taken for a checkpoint;
the same directory copied to a larger disk takes the next checkpoint and resumes from it. Needs root (mount);
skipped, saying why, without it.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mopd_hpc.trainer.checkpoint import load_latest, save_checkpoint

#: One checkpoint of WEIGHT fits (256 KiB of float32 and small JSON files), a second one does not.
WEIGHT = (256, 256)
TMPFS_BYTES = 448 * 1024


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _save(root: Path, step: int) -> Path:
    return save_checkpoint(
        root, step, {"model": {"w": torch.full(WEIGHT, float(step))}}, data_state={"pos": step}
    )


def test_a_full_disk_keeps_the_previous_checkpoint_and_latest(small_disk: Path, tmp_path: Path) -> None:
    root = small_disk / "checkpoints"
    _save(root, 10)
    latest_before = (
        (root / "latest").read_bytes() if (root / "latest").is_file() else os.readlink(root / "latest")
    )
    with pytest.raises(OSError) as info:
        _save(root, 20)
    assert info.value.errno == errno.ENOSPC
    assert str(root) in str(info.value), info.value  # the error names where it was writing
    after = (root / "latest").read_bytes() if (root / "latest").is_file() else os.readlink(root / "latest")
    assert after == latest_before
    ckpt = load_latest(root)
    assert ckpt is not None and ckpt.step == 10 and ckpt.skipped == ()
    assert torch.equal(ckpt.engine_state["model"]["w"], torch.full(WEIGHT, 10.0))
    # a resume on a larger disk: the same directory, copied, continues from step 10 and takes step 20
    bigger = tmp_path / "bigger"
    shutil.copytree(root, bigger, symlinks=True)
    assert load_latest(bigger).step == 10
    _save(bigger, 20)
    resumed = load_latest(bigger)
    assert resumed.step == 20 and torch.equal(resumed.engine_state["model"]["w"], torch.full(WEIGHT, 20.0))
