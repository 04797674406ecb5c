"""Render a `JobSpec` into an sbatch script: a pure function, no Slurm needed (STYLE.md rule 5).

Pattern of torchx `schedulers/slurm_scheduler.py`: `render(spec)` returns an `SbatchRequest` whose `.script`
is the text and whose `show()`/`repr()` print the command and then the script (what `mopd-submit --dry-run`
prints); submitting is `mopd_hpc.launch.slurm`'s side effect.

Templates live in `sbatch_templates/` (jinja2, `StrictUndefined`): `heterogeneous.sbatch.j2` (a Slurm het
job, `#SBATCH hetjob` between components) and `colocated.sbatch.j2` (one component); both include
`_control.sh.j2`, the batch shell's watchdog, signal forwarding and requeue. Every value reaches the script
through `shlex.quote` (the `q` filter): `finalize` rejects any `{{ }}` output that is neither quoted nor an
integer, so a template cannot leak an unquoted string.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from mopd_hpc.launch.jobspec import JobSpec

#: The repository's template folder (beside the package in a source checkout / editable install).
TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "sbatch_templates"
#: Template per job shape.
TEMPLATE_BY_SHAPE = {"heterogeneous": "heterogeneous.sbatch.j2", "colocated": "colocated.sbatch.j2"}
#: The submission command shown by dry runs; `launch.slurm` appends the script path.
SBATCH_COMMAND = ("sbatch", "--parsable")


class RenderError(ValueError):
    """A template is missing or wrote a value without quoting it."""


class _Quoted(str):
    """A string already made safe for the shell (the output of the `q` filter)."""

    __slots__ = ()


@dataclass(frozen=True, slots=True, repr=False)
class SbatchRequest:
    """A rendered job: the command that submits it and the script it submits.

    Attributes:
        cmd: the submission command without the script path, e.g. ("sbatch", "--parsable").
        script: the sbatch script text (bash; `bash -n` clean).
        template: the template file it was rendered from.
        spec: the JobSpec it was rendered from.
    """

    cmd: tuple[str, ...]
    script: str
    template: str
    spec: JobSpec

    def show(self) -> str:
        """The command, then the script (torchx `SlurmBatchRequest.__repr__` layout)."""
        command = " ".join([*(shlex.quote(a) for a in self.cmd), "$SBATCH_SCRIPT"])
        return f"{command}\n\n#------------\n# Script ({self.template})\n#------------\n\n{self.script}"

    def __repr__(self) -> str:
        return self.show()


def render(spec: JobSpec, *, templates_dir: Path | None = None) -> SbatchRequest:
    """Render `spec` into an sbatch script; pure (no files written, no Slurm needed).

    Args:
        spec: a validated JobSpec.
        templates_dir: folder of the jinja2 templates; default `TEMPLATES_DIR`.
    Returns:
        the SbatchRequest (command + script).
    Raises:
        RenderError: the template folder or a template is missing, or a template wrote an unquoted value.
    """
    name = TEMPLATE_BY_SHAPE[spec.shape]
    env = _environment(templates_dir or TEMPLATES_DIR)
    try:
        template = env.get_template(name)
    except jinja2.TemplateNotFound as exc:
        raise RenderError(
            f"sbatch template {exc.name!r} not found in {templates_dir or TEMPLATES_DIR}: "
            "expected the repository's sbatch_templates/ folder"
        ) from None
    script = template.render(
        spec=spec,
        log_pattern=slurm_pattern_escape(f"{spec.run_dir.rstrip('/')}/logs"),
        guard_words=_Quoted(" ".join(shlex.quote(a) for a in spec.guard_command)),
        components_json=json.dumps([c.name for c in spec.components]),
    )
    return SbatchRequest(cmd=SBATCH_COMMAND, script=script, template=name, spec=spec)


def slurm_pattern_escape(path: str) -> str:
    """Double every `%` so that Slurm's filename patterns (`%j`, `%t`, ...) leave `path` as it is (sbatch.1)."""
    return path.replace("%", "%%")


def _quote(value: Any) -> _Quoted:
    if isinstance(value, _Quoted):
        return value
    return _Quoted(shlex.quote(str(value)))


def _sbatch_option(option: str) -> _Quoted:
    """`--key=value` with the value quoted (`--key` alone when it has no value)."""
    key, sep, value = option.partition("=")
    return _Quoted(key + sep + shlex.quote(value) if sep else key)


def _finalize(value: Any) -> Any:
    if isinstance(value, _Quoted) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise RenderError(
        f"template wrote {value!r} ({type(value).__name__}) unquoted: pipe it through `| q` "
        "(shlex.quote) in sbatch_templates/"
    )


def _environment(templates_dir: Path) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir)),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=_finalize,
        # bash's ${#array[@]} would open a jinja comment: comments are {## ... ##} here.
        comment_start_string="{##",
        comment_end_string="##}",
    )
    env.filters["q"] = _quote
    env.filters["sbatch_option"] = _sbatch_option
    return env
