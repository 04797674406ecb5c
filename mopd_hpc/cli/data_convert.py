"""`mopd-data convert INPUT OUTPUT --source NAME [...]`: a jsonl, parquet or `save_to_disk` dataset → the
project's jsonl (`{"prompt", "answer", "source"}` a line; `mopd_hpc.data.convert`), written atomically, with a
report of the rows read and written, duplicate prompts and empty answers. Exit 0 on success, 2 on a file or
row that cannot be converted (nothing is written then)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from mopd_hpc.atomic import atomic_write_text
from mopd_hpc.data.convert import ConvertError, convert_rows, read_rows, to_jsonl
from mopd_hpc.runtime.signals import EXIT_USAGE

HELP = "turn a local dataset (jsonl, parquet, a datasets save_to_disk directory) into the project's jsonl"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", metavar="INPUT", help=".jsonl, .parquet, or a save_to_disk directory")
    parser.add_argument("output", metavar="OUTPUT", help="the .jsonl to write (a data.sources[].path)")
    parser.add_argument("--source", required=True, help="the source name written on every row")
    parser.add_argument("--prompt-key", help="the prompt's field (default: prompt, question, problem, ...)")
    parser.add_argument("--answer-key", help="the answer's field (default: answer, solution, ...)")
    parser.add_argument("--split", help="the split of a DatasetDict directory (e.g. train)")
    parser.add_argument(
        "--final-answer", action="store_true", help="keep only what follows the answer's last '####' (GSM8K)"
    )
    parser.add_argument("--drop-duplicates", action="store_true", help="leave out a prompt seen before")
    parser.add_argument("--drop-empty", action="store_true", help="leave out rows with an empty answer")
    parser.add_argument("--force", action="store_true", help="overwrite OUTPUT if it exists")


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    output = Path(args.output)
    if output.exists() and not args.force:
        print(f"mopd-data convert: {output} exists; --force to overwrite it", file=err)
        return EXIT_USAGE
    try:
        rows, report = convert_rows(
            read_rows(args.input, args.split),
            args.source,
            prompt_key=args.prompt_key,
            answer_key=args.answer_key,
            final_answer=args.final_answer,
            drop_duplicates=args.drop_duplicates,
            drop_empty=args.drop_empty,
        )
    except ConvertError as exc:
        print(f"mopd-data convert: {args.input}: {exc}", file=err)
        return EXIT_USAGE
    if not rows:
        print(f"mopd-data convert: every row was dropped; nothing written to {output}", file=err)
        return EXIT_USAGE
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output, to_jsonl(rows))
    for line in report.lines():
        print(line, file=out)
    print(f"wrote {output}", file=out)
    return 0
