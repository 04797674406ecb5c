"""The `export:` section: the student as a Hugging Face directory every N steps, the last K kept.

Each export is `run_dir/exports/step_<n>/` (config.json, model.safetensors, the tokenizer), written to a
temporary directory and renamed into place (trainer/exports.py); `transformers.AutoModelForCausalLM.
from_pretrained` loads it, and a run config can name it as a teacher or actor path. The student at the end of
the run stays `run_dir/student_final` whatever this section says.
"""

from __future__ import annotations

from pydantic import Field

from mopd_hpc.config.base import Section


class ExportConfig(Section):
    """Periodic Hugging Face exports of the student (module docstring)."""

    interval: int = Field(
        0, ge=0, description="Export the student every this many steps (and at the last step); 0 = none."
    )
    keep: int = Field(
        2, ge=1, description="Exports kept: the newest this many; older ones are deleted after each export."
    )
