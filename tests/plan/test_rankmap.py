"""The rank map's model column (teacher ids) and the probe table (GPUs, the weight-sync rank of the job's
backend, as the dry-run numbers it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from mopd_hpc.config import load_run_config
from mopd_hpc.launch.rankmap import model_cell, probe_report_table, rank_map_rows
from mopd_hpc.plan.placement import place_children
from mopd_hpc.roles.probe import weight_sync_backend

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def render(table: object) -> list[list[str]]:
    """The table's body rows, cells stripped (a wide console: no folding)."""
    console = Console(width=400, record=True, color_system=None)
    console.print(table)
    lines = [x for x in console.export_text().splitlines() if x.startswith("│")]
    return [[c.strip() for c in x.strip("│").split("│")] for x in lines]


def test_teacher_rows_name_their_model() -> None:
    plan = place_children(load_run_config(CONFIGS / "local_cpu.yaml"))
    rows = rank_map_rows(plan, "torch")
    assert [(r["role"], r["index"], r["model"]) for r in rows] == [
        ("actor", "0", "-"), ("teacher", "0", "chain r0"), ("teacher", "1", "legs r0"),
        ("rollout", "0", "-"),
    ]  # fmt: skip
    # a probe plan keeps the model of the teacher each probe stands in for
    probe_rows = rank_map_rows(plan.as_probe(), "torch")
    assert [r["model"] for r in probe_rows] == ["-", "chain r0", "legs r0", "-"]
    assert probe_rows[1]["role"] == "teacher (probe 1)"
    # a teacher over several ranks and nodes: each row names the model, its replica and its TP rank in it
    rows = rank_map_rows(place_children(load_run_config(CONFIGS / "qwen3_coder_4node.yaml")))
    teachers = [(r["node"], r["index"], r["model"]) for r in rows if r["role"] == "teacher"]
    assert teachers[0] == ("0", "0", "coder_teacher r0, tp 0/8")
    assert teachers[9] == ("1", "9", "coder_teacher r1, tp 1/8")
    assert model_cell("rollout", {"MOPD_TEACHER_ID": "x"}) == "-" and model_cell("teacher", {}) == "-"


def _report(plan_role: str, plan_index: int, transfer: list[int], **topo: object) -> dict:
    env = (
        {"MOPD_TEACHER_ID": "chain", "MOPD_RANK": "0", "MOPD_WORLD_SIZE": "1"}
        if plan_role == "teacher"
        else {}
    )
    return {
        "role": "probe", "index": 0, "plan_role": plan_role, "plan_index": plan_index, "host": "n1",
        "transfer_ranks": transfer, "restart_count": 0, "ports": {"http": 6000}, "env": env,
        "weight_sync_backend": "torch",
        "topology": {
            "het_group": 0, "het_size": 1, "node_index": 0, "node_count": 1, "rank": 0, "world_size": 1,
            "local_rank": 0, "local_world_size": 1, "gpu_tokens": [], "local_device_index": None, **topo,
        },
    }  # fmt: skip


def test_probe_table_shows_gpus_and_the_dry_run_weight_sync_rank(tmp_path: Path) -> None:
    # AWEX's numbering (rollout first) is what the reports carry; with backend torch the table must number as
    # the dry-run: actor "0 (source)", rollout engine i "1 + i"
    reports = [
        _report("actor", 0, [2], gpu_tokens=["0", "1"], local_device_index=1),
        _report("teacher", 0, []),
        _report("rollout", 0, [0], gpu_tokens=["GPU-aa"], local_device_index=0),
        _report("rollout", 1, [1]),
    ]
    table = probe_report_table(reports)
    assert [c.header for c in table.columns][3:] == [
        "role", "model", "rank/world", "local", "GPUs", "ports", "torch broadcast rank", "restart",
    ]  # fmt: skip
    rows = render(table)
    assert [(r[3], r[4], r[7], r[9]) for r in rows] == [
        ("actor[0]", "-", "0,1 (from 1)", "0 (source)"),
        ("teacher[0]", "chain", "cpu", "-"),
        ("rollout[0]", "-", "GPU-aa (from GPU-aa)", "1"),
        ("rollout[1]", "-", "cpu", "2"),
    ]
    dry = rank_map_rows(place_children(load_run_config(CONFIGS / "slurm_het_cpu.yaml")), "torch")
    assert [r["broadcast_rank"] for r in dry if r["role"] != "teacher"] == ["0 (source)", "1", "2"]
    # backend awex: the AWEX transfer ranks, labelled as such
    awex = probe_report_table(reports, "awex")
    assert "AWEX transfer rank" in [c.header for c in awex.columns]
    assert [r[9] for r in render(awex)] == ["2", "-", "0", "1"]
    with pytest.raises(ValueError, match=r"weight_sync backend='nccl'"):
        probe_report_table(reports, "nccl")


def test_the_probe_reads_the_weight_sync_backend_of_the_run_config(tmp_path: Path) -> None:
    assert weight_sync_backend(tmp_path) is None  # no config.yaml
    cfg = load_run_config(CONFIGS / "local_cpu.yaml")
    (tmp_path / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
    assert weight_sync_backend(tmp_path) == cfg.weight_sync.backend == "torch"
    (tmp_path / "config.yaml").write_text("weight_sync: [1, 2]\n", encoding="utf-8")
    assert weight_sync_backend(tmp_path) is None
