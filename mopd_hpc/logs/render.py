"""`render_summary(summary, console)`: one screen of rich output. Every string from a log is passed as a
`Text` (never markup), so `[rank0]:` or `[/bold]` in a log line prints as written."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from mopd_hpc.logs.progress import Progress, sparkline
from mopd_hpc.logs.summary import CHECKPOINTED, RunSummary
from mopd_hpc.records.metrics_schema import EVAL_PREFIX, LOSS_KEYS, MOPD_KEYS, PHASE_KEYS, TOKENS_PER_S_KEY

#: Traceback lines shown on screen (the --json output has the whole bounded window).
SCREEN_TRACEBACK_LINES = 14
#: Fewer lines for causes the title and exception line already explain (the path is in the title).
SCREEN_LINES_BY_CAUSE = {"model_path": 6}
_CARETS = frozenset("^~ ")
_STATE_STYLE = {
    "SUCCEEDED": "green",
    "CHECKPOINTED": "yellow",
    "RUNNING": "cyan",
    "PENDING": "yellow",
    "FAILED": "bold red",
    "CANCELLED": "red",
    "running": "cyan",
    "exited": "green",
    "killed": "yellow",
    "stopped": "yellow",
    "failed": "bold red",
}
_TIMES = {1: "once", 2: "twice"}


def _ts(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _fmt(value: float | None) -> str:
    if value is None or value != value:
        return "-"
    return f"{value:.4g}"


def _job_panel(s: RunSummary) -> Panel:
    job = s.job
    head = Text()
    head.append(f"job {job.job_id or '?'}", style="bold")
    if job.name:
        head.append(f"  {job.name}")
    if job.shape:
        head.append(f"  shape={job.shape}")
    head.append("  state ")
    head.append(job.state, style=_STATE_STYLE.get(job.state, ""))
    head.append(f" (from {job.state_source})  restarts {job.restart_count}")
    parts: list[Text | Table] = [head]
    if job.restart_count > 0:
        n = job.restart_count
        then = {
            "SUCCEEDED": "finished",
            "RUNNING": "running",
            "CHECKPOINTED": "stopped on a checkpoint signal",
        }
        parts.append(
            Text(
                f"requeued {_TIMES.get(n, f'{n} times')}, resumed, {then.get(job.state, job.state.lower())}"
                " (only this incarnation is summarized)"
            )
        )
    for label, jobs in (("earlier", job.earlier_jobs), ("later", job.later_jobs)):
        if jobs:
            listed = ", ".join(f"{jid} {state}" for jid, state in jobs)
            parts.append(Text(f"{label} jobs in this run dir: {listed}", style="dim"))
    for refused, host, pid, ts in job.refused:  # turned away by the run-dir lock while this job held it
        who = f"job {refused}" if refused else "a submission"
        parts.append(
            Text(
                f"refused while this job held the run dir: {who} (host {host}, pid {pid}) at {_ts(ts)}",
                style="yellow",
            )
        )
    for warning in job.unverified:  # let through by allow_unverified: code not yet run on GPUs here
        parts.append(Text(f"ran unverified (allow_unverified): {warning}", style="yellow"))
    if job.state == CHECKPOINTED:
        at = f"step {job.end_step}" if job.end_step is not None else "its last checkpoint"
        parts.append(
            Text(
                f"stopped at {at} on a checkpoint signal (SIGUSR2): not finished; resume it by re-running "
                "the same command (see next:)",
                style="yellow",
            )
        )
    if job.sacct is not None:
        table = Table(box=None, pad_edge=False, show_header=True, header_style="dim")
        for col in ("component", "name", "state", "exit", "elapsed/limit", "nodes", "runs"):
            table.add_column(col)
        for c in job.sacct.components:
            table.add_row(
                c.component_id,
                Text(c.name),
                Text(c.state, style=_STATE_STYLE.get(c.coarse_state, "")),
                c.exit_code,
                f"{c.elapsed}/{c.time_limit}",
                Text(c.node_list),
                str(c.incarnations),
            )
        parts.append(table)
    elif job.components:
        parts.append(Text(f"components: {', '.join(job.components)}"))
    return Panel(Group(*parts), title=Text(f"mopd run {s.run_dir}"), title_align="left")


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] → "0-2,5"."""
    out, start, prev = [], None, None
    for i in [*sorted(indices), None]:
        if start is None:
            start = prev = i
        elif i is not None and prev is not None and i == prev + 1:
            prev = i
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = i
    return ",".join(out)


def _nodes_table(s: RunSummary) -> Table:
    """One row per (host, role, state, how it ended): 64 ranks that failed alike take one line."""
    table = Table(title="children per node and role", title_justify="left", box=None, header_style="dim")
    for col in ("host", "role", "index", "state", "exit", "restarts"):
        table.add_column(col)
    groups: dict[tuple[str, str, str, str], list[tuple[int, int]]] = {}
    for slot in s.children:
        c = slot.latest
        ended = c.signal or ("-" if c.exit_code is None else str(c.exit_code))
        groups.setdefault((slot.host, slot.role, slot.state, ended), []).append((slot.index, slot.restarts))
    for (host, role, state, ended), members in groups.items():
        table.add_row(
            Text(host),
            Text(role),
            _ranges([i for i, _ in members]),
            Text(
                f"{state} ×{len(members)}" if len(members) > 1 else state, style=_STATE_STYLE.get(state, "")
            ),
            ended,
            str(sum(r for _, r in members)),
        )
    for g in s.guards:
        if g.signals:
            table.add_row(Text(g.host), "guard", "-", "signalled", ", ".join(n for _, n in g.signals), "")
        elif g.died:
            ended = g.exit_signal or str(g.exit_code)
            table.add_row(
                Text(g.host), "guard", "-", Text("died", style=_STATE_STYLE.get("failed", "")), ended, ""
            )
    return table


def screen_traceback(lines: Sequence[str], limit: int) -> tuple[list[str], int]:
    """The part of a traceback worth a screen: its last chained block (after the last `Traceback (...)`
    header), without the `^^^^` marker lines, at most `limit` lines: the first frame (who called) and the
    last ones. Returns (lines, how many lines of `lines` are not shown)."""
    start = max((i for i, x in enumerate(lines) if x.startswith("Traceback (")), default=0)
    block = [x for x in lines[start:] if x.strip() and not set(x) <= _CARETS]
    if len(block) > limit:
        head = block[1:3] if len(block) > 2 and block[1].lstrip().startswith("File ") else []
        head = head if len(head) == 2 and not head[1].lstrip().startswith("File ") else head[:1]
        tail = block[len(block) - (limit - len(head) - 1) :]
        while len(tail) > 1 and tail[0][:1].isspace() and not tail[0].lstrip().startswith("File "):
            tail = tail[1:]  # start the tail at a frame, not under one
        block = [*head, "...", *tail] if head else block[-limit:]
    return block, len(lines) - len([x for x in block if x != "..."])


def _failure_panel(s: RunSummary) -> Panel:
    f = s.first_failure
    if f is None:
        return Panel(Text("no failure found", style="green"), title="first failure", title_align="left")
    lines = Text()
    lines.append(f.cause.title, style="bold red")
    where = f" on {f.host}" if f.host else ""
    who = f" {f.role}-{f.index}" if f.role is not None else ""
    lines.append(f" —{who}{where} at {_ts(f.ts)}")
    if f.exit_code is not None or f.signal:
        lines.append(f" ({f.signal or f'exit code {f.exit_code}'})")
    lines.append("\n")
    if f.cause.evidence:
        lines.append(f.cause.evidence + "\n", style="red")
    limit = SCREEN_LINES_BY_CAUSE.get(f.cause.key, SCREEN_TRACEBACK_LINES)
    if f.traceback:
        shown, hidden = screen_traceback(f.traceback, limit)
        if len(shown) > 1 and shown[-1].strip() == (f.cause.evidence or "").strip():
            shown, hidden = shown[:-1], hidden + 1  # the exception line is printed just above
        if hidden > 0:
            lines.append(f"  ... ({hidden} more lines in --json)\n", style="dim")
        lines.append("\n".join(shown) + "\n", style="dim")
    elif f.log_tail:
        lines.append("\n".join(f.log_tail[-limit:]) + "\n", style="dim")
    if f.same_on:
        names = ", ".join(f.same_on[:6]) + (", ..." if len(f.same_on) > 6 else "")
        n = len(f.same_on)
        lines.append(f"same on {n} other rank{'s' if n != 1 else ''}: {names}\n", style="yellow")
    if f.cascade:
        then = ", ".join(f"{label} ({key})" for label, key in f.cascade[:6])
        lines.append(f"then (cascade): {then}\n", style="yellow")
    if f.log_path:
        lines.append(f"log: {f.log_path}", style="dim")
    return Panel(lines, title="first failure", title_align="left", border_style="red")


def _trend_label(p: Progress) -> str:
    """ "trend, steps 1–2500 (mean per ~104 steps)": the whole range the sparklines cover."""
    if p.trend_steps is None:
        return "trend"
    first, last = p.trend_steps
    buckets = max((len(v) for v in p.trend.values()), default=0)
    per = (last - first + 1) / buckets if buckets else 0
    each = "each step" if per <= 1 else f"mean per {'' if per == int(per) else '~'}{per:.0f} steps"
    return f"trend, steps {first}–{last} ({each})"


#: The heading of the progress panel's memory table.
MEMORY_HEADING = "peak GPU memory per phase, GiB allocated / reserved (max over steps)"


def _memory_table(memory: dict[str, dict[str, dict[str, float]]]) -> Table:
    """Peak GPU memory per child (rows) and phase (columns, the step's order): allocated / reserved GiB, the
    maximum over the run's steps (shown under `MEMORY_HEADING`)."""
    order = {ph: i for i, ph in enumerate(PHASE_KEYS.values())}
    phases = sorted(
        {ph for per in memory.values() for ph in per}, key=lambda ph: (order.get(ph, len(order)), ph)
    )
    table = Table(box=None, header_style="dim")
    table.add_column("child")
    for ph in phases:
        table.add_column(ph, justify="right")
    for child, per in memory.items():
        cells = []
        for ph in phases:
            kinds = per.get(ph, {})
            alloc, res = kinds.get("allocated_gib"), kinds.get("reserved_gib")
            cells.append("-" if alloc is None and res is None else f"{_gib(alloc)} / {_gib(res)}")
        table.add_row(Text(child), *cells)
    return table


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _progress_panel(s: RunSummary) -> Panel:
    p = s.progress
    if p.n_lines == 0:
        probes = bool(s.children) and all(c.role == "probe" for c in s.children)
        text = (
            "probe run: the children report their environment and exit, no training metrics"
            if probes
            else "no metrics yet (run_dir/metrics.jsonl)"
        )
        return Panel(Text(text, style="dim"), title="training", title_align="left")
    table = Table(box=None, show_header=True, pad_edge=False, header_style="dim")
    table.add_column("metric")
    table.add_column("last", justify="right")
    table.add_column(_trend_label(p))
    keys = [k for k in (*LOSS_KEYS, *MOPD_KEYS[:1], TOKENS_PER_S_KEY) if k in p.last]
    keys += [f"{fam}/{r}" for r in p.routes for fam in ("reward", "accuracy") if f"{fam}/{r}" in p.last]
    for key in keys:
        table.add_row(Text(key), _fmt(p.last.get(key)), sparkline(p.trend.get(key, [])))
    for key in sorted(k for k in p.series if k.startswith(EVAL_PREFIX) and p.series[k]):  # held-out points
        table.add_row(Text(key), _fmt(p.series[key][-1][1]), sparkline(p.trend.get(key, [])))
    share = "  ".join(f"{name} {frac:.0%}" for name, frac in p.phase_share.items() if frac > 0)
    head = Text(f"step {p.last_step} at {_ts(p.last_ts)}   time per phase: {share or '-'}")
    parts: list[Text | Table] = [head, table]
    if p.memory:
        parts += [Text(MEMORY_HEADING), _memory_table(p.memory)]
    if p.eval:
        ev = Table(title="eval", title_justify="left", box=None, header_style="dim")
        for col in ("route", "teacher", "student start", "student end", "n"):
            ev.add_column(col)
        for route, row in p.eval.items():
            if isinstance(row, dict):
                ev.add_row(
                    Text(str(route)),
                    *(_fmt(row.get(k)) for k in ("teacher", "student_start", "student_end")),
                    str(row.get("n", "-")),
                )
        parts.append(ev)
    return Panel(Group(*parts), title="training", title_align="left")


def render_summary(summary: RunSummary, console: Console) -> None:
    """Print `summary` on `console` (job, children, first failure, training progress, what could not be
    read, next steps)."""
    console.print(_job_panel(summary))
    if summary.children or summary.guards:
        console.print(_nodes_table(summary))
    console.print(_failure_panel(summary))
    console.print(_progress_panel(summary))
    for item in summary.unreadable:
        console.print(Text(f"skipped: {item.describe()}", style="yellow"))
    if summary.next_steps:
        console.print(Text("next:", style="bold"))
        for command in summary.next_steps:
            console.print(Text(f"  {command}"))
