"""The plain loop with a signal in it, for the tests of what a signal does mid-run.

conftest's ``train_loop`` runs the plain loop to its end; a test of a pre-emption or a
kill needs the same loop with a real signal sent from inside it, after a given step.
Worker scripts that put ``tests/`` on ``sys.path`` import it as ``from _loops import
train_loop_signalled``."""

from __future__ import annotations

import signal


def train_loop_signalled(
    g, model, opt, *, after_step: int | None, signum: int = signal.SIGTERM
) -> None:
    """conftest's plain loop over a guard's batches (``model(x, y).backward()``,
    ``opt.step()``, ``opt.zero_grad()``), with ``signum`` raised in this process right
    after step ``after_step`` (a launcher's SIGTERM, a SIGKILL); ``None``: no signal.
    The loop goes on wherever the guard lets it (a stop it decides ends the batches)."""
    for x, y in g:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        if g.step == after_step:
            signal.raise_signal(signum)
