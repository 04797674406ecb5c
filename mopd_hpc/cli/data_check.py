"""`mopd-data check FILE [--source NAME] [--reward math]`: read a project jsonl as the job reads it (`JsonlSource`:
every line `{"prompt": non-empty str, "answer": str}`, errors named file:line) and report its rows, duplicate
prompts and empty answers; with `--reward math`, also the rows whose answer the math reward cannot read (the job
would stop at them). Exit 0 when it reads (and every answer parses), 2 when it does not."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from mopd_hpc.data.convert import convert_rows, rows_note
from mopd_hpc.data.errors import DataSourceError, JsonlFormatError
from mopd_hpc.data.sources import JsonlSource
from mopd_hpc.runtime.signals import EXIT_USAGE

HELP = "read a project jsonl as the job does and report rows, duplicate prompts and empty answers"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="a .jsonl of {prompt, answer} rows")
    parser.add_argument("--source", default="check", help="the source name errors are reported under")
    parser.add_argument(
        "--reward", choices=["math"], help="also check that every answer is one this reward reads"
    )


def convert_hint(path: str, fields: tuple[str, ...]) -> str:
    """The way out for a raw dataset's row (no `prompt`/`answer` field; `fields`: the ones it has): convert it
    first, as the README's GSM8K recipe does."""
    have = ", ".join(map(repr, fields)) or "none"
    return (
        f"  its fields are {have}: a raw dataset is made a project jsonl with "
        f"`mopd-data convert {path} OUT.jsonl --source NAME` (--prompt-key/--answer-key name its fields when "
        "they are not found; --final-answer keeps what follows GSM8K's '####'), then `mopd-data check OUT.jsonl`"
    )


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    try:
        source = JsonlSource.from_path(args.source, args.file)
    except DataSourceError as exc:
        print(f"mopd-data check: {exc}", file=err)
        if isinstance(exc, JsonlFormatError) and exc.fields is not None:
            print(convert_hint(args.file, exc.fields), file=err)
        return EXIT_USAGE
    _, report = convert_rows([p.entry for p in source], args.source, prompt_key="prompt", answer_key="answer")
    for line in report.lines(wrote=False):
        print(line, file=out)
    if args.reward == "math":
        from mopd_hpc.data.verifiers import parses_as_math

        bad = tuple(p.index for p in source if not parses_as_math(p.answer))
        print(f"answers the math reward cannot read: {len(bad)}{rows_note(bad)}", file=out)
        if bad:
            return EXIT_USAGE
    return 0
