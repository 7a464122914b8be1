"""``python -m guardrails.run SCRIPT [ARGS...]``: run a training script that has no
``main()`` to decorate (nanochat's ``base_train.py``) under ``@guardrails.record``.

    python -m guardrails.run train.py --lr 3e-4
    python -m guardrails run train.py --lr 3e-4                  # the same
    torchrun --nproc-per-node 8 -m guardrails.run train.py --lr 3e-4
    torchrun --nproc-per-node 8 -m guardrails.run -m scripts.base_train --depth=20

The script runs as ``__main__`` exactly as ``python SCRIPT ARGS`` (or ``python -m
MODULE ARGS``) would run it (``sys.argv``, ``sys.path[0]``), and ends as a decorated
``main()`` does: a :class:`~guardrails.GuardrailsError` writes torchrun's error file,
prints one summary and exits with its class's code; a signal stop says "pre-empted by
SIGTERM at step N ..." in the error file; a guard the script left open is closed first.
Under a single-node ``torchrun --max-restarts``, the script's ``init_process_group``,
at module level too, connects through a store of the attempt's own (see
:mod:`guardrails.distributed.attempt`), and a restart after a failure no restart can fix
is refused before the script runs.
"""

from __future__ import annotations

import os
import runpy
import sys

from guardrails.engine.record import record

USAGE = (
    "usage: python -m guardrails.run SCRIPT [ARGS...]\n"
    "       python -m guardrails.run -m MODULE [ARGS...]\n"
    "Runs a training script (or module) as __main__ under @guardrails.record."
)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit(f"guardrails.run: -m needs a module name\n{USAGE}")
        module, rest = argv[1], argv[2:]
        sys.argv = [module, *rest]
        sys.path.insert(0, os.getcwd())  # as `python -m MODULE` does
        record(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))()
        return
    script, rest = argv[0], argv[1:]
    if not os.path.isfile(script):
        raise SystemExit(f"guardrails.run: no such script: {script}\n{USAGE}")
    sys.argv = [script, *rest]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` does
    record(lambda: runpy.run_path(script, run_name="__main__"))()


def add_parser(sub: object) -> None:
    """``python -m guardrails run``: the same, as a subcommand."""
    import argparse

    p = sub.add_parser(  # type: ignore[attr-defined]
        "run",
        help="run a training script (no main() needed) under @guardrails.record",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("-m", dest="module", help="run this module instead of a script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="SCRIPT and its arguments")
    p.set_defaults(func=_from_cli)


def _from_cli(args: object) -> int:
    module = getattr(args, "module", None)
    rest = list(getattr(args, "args", []))
    main(["-m", module, *rest] if module else rest)
    return 0


if __name__ == "__main__":
    main()
