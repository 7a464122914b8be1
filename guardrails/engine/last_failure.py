"""``run_dir/last_failure.json``: how the last run in this directory ended, so that a
torchrun restart after a failure no restart can fix is refused at once.

``torchrun --max-restarts N`` restarts the workers whatever they died of. A desync
(``CollectiveMismatchError``), uneven data or a checkpoint that does not fit comes back
on every attempt: N times the startup and the steps up to the failure, and N reports
of the same failure (issue 50). So:

* **Written** (:func:`write`) by every rank that ends with a guardrails error (through
  ``@guardrails.record`` or ``process.die``), atomically (a temporary file renamed over
  the last): the error's class, exit code, whether a restart can fix it, its message
  and hint, rank and step, when, torchelastic's run id and restart count, this rank's
  agent (host and parent pid) and a fingerprint of the entry script. A restartable
  failure does not replace an unfixable one of the same attempt (a survivor's
  ``RankFailedError`` after a peer's ``UnevenDataError`` must not hide the cause).
* **Checked** twice, on every rank. First before ``main`` (:func:`check_before_main`,
  ``@guardrails.record``): the same record sits in torchrun's error file of each rank
  of the attempt before (``extraInfo.failure``), found through this rank's own error
  file's path, so a refusal costs the restart its interpreter's start and no more:
  no process group, no data, no model. Then when a guard starts, before its first
  store call and step (:func:`check_at_start`, for a ``main`` without ``@record`` or
  another log layout): ``last_failure.json`` of an unfixable failure from an earlier
  attempt of *the same torchrun job* (same ``TORCHELASTIC_RUN_ID``, a lower restart
  count; and for torchrun's default id ``none``, which every job without
  ``--rdzv-id`` shares, the same agent). Either way, with the same entry script, it is
  raised again as the same class with the same exit code and message, plus "this
  failure recurs on every restart". The refusal is itself recorded, with this
  attempt's count, so every later restart is refused too.

**A requeue is not refused** (a new job: another run id, or a restart count that
starts again at 0), only warned about, once, by rank 0: a person or a scheduler who
launches again has usually changed something the fingerprint cannot see (a module the
script imports, the data, the environment), and refusing a fix would be worse than one
more failed attempt. ``GUARDRAILS_RETRY_UNFIXABLE=1`` or deleting the file lets a
restart try anyway.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from guardrails import _errors
from guardrails._errors import GuardrailsError
from guardrails.util import files

log = logging.getLogger("guardrails.guard")

FILE_NAME = "last_failure.json"
#: Set to 1 to let a restart run after a failure a restart cannot fix.
RETRY_ENV = "GUARDRAILS_RETRY_UNFIXABLE"

#: The run directory of the guard this process started last: where :func:`write`
#: records the failure that ends the process (set by :func:`check_at_start`).
_run_dir: Path | None = None


def _this_attempt() -> dict[str, Any]:
    """Who is writing or reading: the torchrun job and attempt, the agent, the script."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    return {
        "torchelastic_run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        "restart_count": int(count) if count.isdigit() else None,
        "agent": f"{socket.gethostname()}:{os.getppid()}",
        "entry": _fingerprint(),
    }


def _fingerprint() -> str:
    """sha256 (16 hex digits) of the entry script's bytes (``sys.argv[0]``; under
    ``python -m guardrails.run`` the user's script), or of its name when it is no file."""
    entry = sys.argv[0] if sys.argv else ""
    digest = hashlib.sha256()
    try:
        with open(entry, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        digest.update(entry.encode())
    return digest.hexdigest()[:16]


def describe(error: GuardrailsError, *, exit_code: int) -> dict[str, Any]:
    """The record of ``error`` ending this process with ``exit_code``: what
    ``last_failure.json`` holds, and torchrun's error file under ``extraInfo.failure``."""
    now = _this_attempt()
    original = getattr(error, "recurring_from", None)  # a refusal: keep the cause's words
    record = {
        "error_class": type(error).__name__,
        "exit_code": exit_code,
        "restartable": type(error).restartable,
        "message": original["message"] if original else error.message,
        "hint": original["hint"] if original else error.hint,
        "rank": error.rank,
        "step": original["step"] if original else error.step,
        "time": time.time(),
        # The attempt the failure first ended, and when: a refusal repeats them.
        "first_restart_count": original.get("first_restart_count") if original else None,
        "first_time": original.get("first_time") if original else None,
        **now,
    }
    if record["first_restart_count"] is None:
        record["first_restart_count"] = now["restart_count"]
    if record["first_time"] is None:
        record["first_time"] = record["time"]
    return record


def write(error: BaseException, *, exit_code: int, run_dir: Path | None = None) -> None:
    """Record ``error`` (a guardrails error; others are ignored), ending the process
    with ``exit_code``, as the run's ending failure in ``run_dir`` (default: the last
    started guard's). Best effort: a report that cannot be written must not replace
    the error."""
    run_dir = _run_dir if run_dir is None else run_dir
    if run_dir is None or not isinstance(error, GuardrailsError):
        return
    path = run_dir / FILE_NAME
    record = describe(error, exit_code=exit_code)
    now = _this_attempt()
    previous = _read(path)
    if (
        record["restartable"]
        and previous is not None
        and not previous.get("restartable", True)
        and _same(previous, now, "torchelastic_run_id", "restart_count", "agent")
    ):
        return  # an unfixable failure of this same attempt is the cause: keep it
    temporary = path.with_name(f".{FILE_NAME}.{os.getpid()}.tmp")
    try:
        files.write_text(temporary, json.dumps(record, default=str, indent=1))
        os.replace(temporary, path)
    except OSError as exc:
        log.warning("guardrails: could not record the failure in %s: %s", path, exc)
        with contextlib.suppress(OSError):
            os.unlink(temporary)


def check_before_main() -> None:
    """Under a torchrun restart, before ``main`` (``@guardrails.record``): raise again
    a failure no restart can fix that ended the attempt before, read from that
    attempt's error files, so the restart ends within a second of its start, before
    the process group, the data and the model. torchrun keeps them in
    ``<log_dir>/<run id>/attempt_<K>/<local rank>/error.json``
    (``DefaultLogsSpecs``); under another layout nothing is found here and the guard's
    start refuses instead (:func:`check_at_start`)."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not count.isdigit() or int(count) == 0 or not error_file:
        return
    if os.environ.get(RETRY_ENV) == "1":
        return
    attempt_dir = Path(error_file).parent.parent
    if attempt_dir.name != f"attempt_{count}":
        return
    now = _this_attempt()
    for path in sorted((attempt_dir.parent / f"attempt_{int(count) - 1}").glob("*/error.json")):
        failure = (_read(path) or {}).get("message", {})
        failure = failure.get("extraInfo", {}).get("failure") if isinstance(failure, dict) else None
        if (
            isinstance(failure, dict)
            and failure.get("restartable") is False
            and _same(failure, now, "torchelastic_run_id", "entry")
        ):
            rank = os.environ.get("RANK", "")
            raise _recurring(failure, path, int(rank) if rank.isdigit() else None)


def check_at_start(run_dir: Path, rank: int) -> None:
    """At a guard's start: remember ``run_dir`` for :func:`write`, and raise the
    failure recorded there again if it recurs on every restart and this is a restart
    of the same torchrun job (see the module docstring)."""
    global _run_dir
    _run_dir = run_dir
    path = run_dir / FILE_NAME
    previous = _read(path)
    if previous is None or previous.get("restartable", True):
        return
    now = _this_attempt()
    same_job = (
        now["torchelastic_run_id"] is not None
        and _same(previous, now, "torchelastic_run_id")
        and (now["torchelastic_run_id"] != "none" or _same(previous, now, "agent"))
        and isinstance(previous.get("restart_count"), int)
        and now["restart_count"] is not None
        and now["restart_count"] > previous["restart_count"]
    )
    unchanged = _same(previous, now, "entry")
    retry = os.environ.get(RETRY_ENV) == "1"
    if same_job and unchanged and not retry:
        raise _recurring(previous, path, rank)
    if rank == 0:
        why = (
            f"{RETRY_ENV}=1 is set"
            if same_job and unchanged
            else "the entry script changed since"
            if same_job
            else "this is a new launch, not a restart of that job"
        )
        log.warning(
            "guardrails: the last run in %s ended with %s (exit code %s) at step %s, a "
            "failure a restart does not fix: %s. Starting anyway (%s).",
            run_dir,
            previous.get("error_class"),
            previous.get("exit_code"),
            previous.get("step"),
            str(previous.get("message", "")).splitlines()[0][:300],
            why,
        )


def forget() -> None:
    """The guard's run directory is no longer where this process's failure goes
    (``@guardrails.record``'s ``main`` returned): a later error outside any guard
    writes nothing."""
    global _run_dir
    _run_dir = None


def _recurring(previous: dict[str, Any], path: Path, rank: int | None) -> GuardrailsError:
    """The recorded failure as an error of its own class (so its exit code), refused."""
    cls = getattr(_errors, str(previous.get("error_class")), None)
    if not (isinstance(cls, type) and issubclass(cls, GuardrailsError)):
        cls = GuardrailsError
    first = previous.get("first_restart_count", previous.get("restart_count"))
    ago = time.time() - float(previous.get("first_time") or previous.get("time") or time.time())
    message = (
        f"{previous.get('message', '')}\n(refused before training: this failure ended "
        f"attempt {first} of this torchrun job at step {previous.get('step')}, "
        f"{ago:.0f} s ago; this failure recurs on every restart; fix it and relaunch)"
    )
    hint = (
        f"{previous.get('hint') or 'fix the cause above'}. A restart will fail the same "
        f"way, so each one is refused at once. To try anyway: {RETRY_ENV}=1"
        + (f", or delete {path}." if path.name == FILE_NAME else ".")
    )
    return cls(message, rank=rank, step=None, hint=hint, recurring_from=previous)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _same(a: dict[str, Any], b: dict[str, Any], *keys: str) -> bool:
    return all(a.get(k) == b.get(k) for k in keys)
