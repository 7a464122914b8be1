"""``python -m guardrails COMMAND``: the command-line tools.

One subcommand per module; each module has ``add_parser(subparsers)`` (which sets
``func``) and ``main(args) -> exit code``, so adding one (``bench``, ``inspect``) is
one entry in ``COMMANDS``. Keep those modules' top-level imports light: heavy or
optional ones (matplotlib, pynvml) are imported inside the command.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand -> module with ``add_parser`` and ``main``.
COMMANDS = {
    "bench": "guardrails._bench",
    "doctor": "guardrails._doctor",
    "inspect": "guardrails._inspect",
    "report": "guardrails._report",
    "run": "guardrails.run",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        # `guardrails ...` (the console script) or `python -m guardrails ...`.
        prog="python -m guardrails" if sys.argv[0].endswith("__main__.py") else "guardrails",
        description="guardrails: diagnose the environment (doctor), summarise runs (report), "
        "list checkpoints (inspect), measure the guards' cost (bench) and run a script with "
        "no main() under @guardrails.record (run).",
    )
    sub = parser.add_subparsers(
        dest="command", metavar="{" + ",".join(COMMANDS) + "}", required=True
    )
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
