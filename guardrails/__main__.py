"""``python -m guardrails COMMAND``: the command-line tools.

One subcommand per module; each module has ``add_parser(subparsers)`` (which sets
``func``) and ``main(args) -> exit code``, so adding one (``bench``, ``inspect``) is one
entry in ``COMMANDS``. Only the module of the command being run is imported (``--help``
imports none): ``report`` and ``inspect`` need no torch, and importing it (~2.3 s on a
a CPU host) would be most of their start (``report`` starts in 0.5 s median without
it). Keep those modules' top-level imports light: heavy or optional ones (torch where
only one command path needs it, matplotlib, pynvml) are imported inside the command.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

#: subcommand -> (module with ``add_parser`` and ``main``, its one-line help). The help
#: is the module's own (a test keeps them equal): ``--help`` lists it without the import.
COMMANDS = {
    "bench": (
        "guardrails.cli.bench",
        "per-step cost of each guard on a GPT-2-shaped model vs the unguarded loop",
    ),
    "doctor": (
        "guardrails.cli.doctor",
        "environment report: versions, GPUs, env flags, port, zombies",
    ),
    "inspect": (
        "guardrails.cli.inspect",
        "list a directory's checkpoints: valid or not (and why), step, size, contents",
    ),
    "report": (
        "guardrails.cli.report",
        "a run's story from metrics.parquet and the events files, and a PNG",
    ),
    "run": ("guardrails.run", "run a training script (no main() needed) under @guardrails.record"),
    "stacks": (
        "guardrails.cli.stacks",
        "every rank's Python stacks now, grouped by identical stacks",
    ),
    "top": (
        "guardrails.cli.top",
        "a running job's ranks live: step, step time, phases, CPU, GPU, last event",
    ),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for ``argv`` (default ``sys.argv[1:]``): the named command's own,
    the others listed by name and help only."""
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = argparse.ArgumentParser(
        # `guardrails ...` (the console script) or `python -m guardrails ...`.
        prog="python -m guardrails" if sys.argv[0].endswith("__main__.py") else "guardrails",
        description="guardrails: diagnose the environment (doctor), summarise runs (report), "
        "list checkpoints (inspect), measure the guards' cost (bench), run a script with "
        "no main() under @guardrails.record (run), and look at a running job: its ranks "
        "(top) and their stacks (stacks).",
    )
    sub = parser.add_subparsers(
        dest="command", metavar="{" + ",".join(COMMANDS) + "}", required=True
    )
    for name, (module, help_text) in COMMANDS.items():
        if name == chosen:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # `guardrails report RUN | head`: the reader left early; not a failure to show as
        # a traceback. Exit as a tool stopped by SIGPIPE does (128 + 13), with stdout
        # pointed at /dev/null so the interpreter's last flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
