"""A thin command class per verb; logic lives in functions that take their collaborators.

Pattern of torchx `cli/cmd_base.py` + `cli/main.py` (STYLE.md rule 13): each verb is a module exposing
`add_arguments(parser)` and `run(args) -> int`; a program is a `{verb: "module.path"}` table,
imported lazily so that `mopd-debug topology` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Mapping, Sequence

#: Exit status when the reader of stdout went away (128 + SIGPIPE, as a shell reports it).
EXIT_BROKEN_PIPE = 141


def dispatch(prog: str, description: str, verbs: Mapping[str, str], argv: Sequence[str] | None) -> int:
    """Parse `argv` as `prog VERB ...`, import the verb's module and call its `run(args)`.

    Args:
        verbs: verb name → module path; the module defines `HELP: str`, `add_arguments(parser)` and
            `run(args) -> int`.
    Returns:
        the verb's exit code.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    modules = {}
    for verb, module_path in verbs.items():
        module = importlib.import_module(module_path)
        modules[verb] = module
        p = sub.add_parser(verb, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return int(modules[args.verb].run(args))
    except BrokenPipeError:  # `... | head` closed the pipe: stop quietly (Python's documented recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
