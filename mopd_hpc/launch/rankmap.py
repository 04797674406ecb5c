"""The dry-run rank map: one row per planned child (component, node, role, index, GPUs, named ports, AWEX
transfer ranks), as `mopd-submit --dry-run` prints it. Ports are leased when the guard starts the child:
the map names them, 'assigned at start'."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from mopd_hpc.launch.plan import JobPlan

#: What the ports column says about port numbers before the job runs.
PORTS_NOTE = "assigned at start"


def compact_ranges(values: Sequence[int]) -> str:
    """`[0, 1, 2, 3, 8]` → `"0-3,8"`; `[]` → `"-"`."""
    if not values:
        return "-"
    out, start, prev = [], values[0], values[0]
    for v in [*values[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(f"{start}-{prev}" if prev > start else str(start))
        if v is not None:
            start = prev = v
    return ",".join(out)


def rank_map_rows(plan: JobPlan) -> list[dict[str, str]]:
    """The rows of the rank map as strings (the table's columns), one per child, in plan order."""
    rows = []
    for child in plan.children:
        group = plan.groups[child.het_group]
        gpus = ",".join(child.gpus) if child.gpus else "cpu"
        if child.device_index is not None:
            gpus += f" (from {child.gpus[child.device_index]})"
        env = child.env_dict
        role, index = child.role, str(child.index)
        if "MOPD_PLAN_ROLE" in env:  # a probe standing in for another role: show what it stands for
            role, index = f"{env['MOPD_PLAN_ROLE']} (probe {child.index})", env["MOPD_PLAN_INDEX"]
        rows.append(
            {
                "component": f"{child.het_group}:{group.name}",
                "node": str(child.node_index),
                "role": role,
                "index": index,
                "gpus": gpus,
                "ports": f"{', '.join(child.port_names)} ({PORTS_NOTE})" if child.port_names else "-",
                "transfer_rank": compact_ranges(child.transfer_ranks),
            }
        )
    return rows


def rank_map_table(plan: JobPlan) -> Table:
    """A rich Table of `rank_map_rows(plan)` with a title giving the world sizes."""
    title = (
        f"rank map of {plan.name!r}: {len(plan.children)} children"
        f"{' (probe-only: every child runs the probe role)' if plan.probe else ''}; "
        f"AWEX infer world {plan.infer_world} + train world {plan.train_world} = {plan.transfer_world}"
    )
    table = Table(title=title, title_justify="left")
    headers = ("component", "node", "role", "index", "GPUs", "named ports", "AWEX transfer rank")
    for header in headers:
        table.add_column(header, overflow="fold")
    for row in rank_map_rows(plan):
        table.add_row(*row.values())
    return table


def print_rank_map(plan: JobPlan, console: Console) -> None:
    console.print(rank_map_table(plan))


def read_probe_reports(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every probe report under run_dir/probe/ (written by `mopd_hpc.runtime.probe`), sorted by index."""
    reports = []
    for path in sorted(Path(run_dir, "probe").glob("*.json")):
        try:
            reports.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return sorted(reports, key=lambda r: (r.get("role", ""), r.get("index", 0)))


def probe_report_table(reports: Sequence[dict[str, Any]]) -> Table:
    """What the probes reported: host, het group/node, the role stood in for, ranks, ports, transfer ranks."""
    table = Table(title=f"what the {len(reports)} probe(s) reported", title_justify="left")
    for header in (
        "host",
        "het group",
        "node",
        "role",
        "rank/world",
        "local",
        "ports",
        "transfer",
        "restart",
    ):
        table.add_column(header, overflow="fold")
    for r in reports:
        topo = r.get("topology", {})
        role = (
            f"{r.get('plan_role')}[{r.get('plan_index')}]"
            if r.get("plan_role")
            else f"{r['role']}[{r['index']}]"
        )
        table.add_row(
            str(r.get("host")),
            f"{topo.get('het_group')}/{topo.get('het_size')}",
            f"{topo.get('node_index')}/{topo.get('node_count')}",
            role,
            f"{topo.get('rank')}/{topo.get('world_size')}",
            f"{topo.get('local_rank')}/{topo.get('local_world_size')}",
            ", ".join(f"{k}={v}" for k, v in sorted(r.get("ports", {}).items())) or "-",
            compact_ranges(r.get("transfer_ranks", [])),
            str(r.get("restart_count")),
        )
    return table
