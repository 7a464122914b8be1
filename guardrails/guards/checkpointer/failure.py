"""The failure save: when a run ends on a failure that leaves the process alive, each rank
writes the newest *consistent* state it holds, and ``resume="auto"`` continues from it.

Without it every failure but a signal ended each rank with an error and saved nothing
(periodic checkpoints are off by default): a hang at hour 20 lost 20 hours.

* **Which failures**: an exception that ends the loop (a NaN streak without rewind, a
  desync, a bad batch, the loop's own error), raised in the main thread (``on_end``), and
  a verdict that ends the process from the watchdog's or auditor's thread while the main
  thread is stuck (a hang on the ranks that are not stuck, a peer's death seen by the
  survivors: ``on_abort``, the thread's last words). Not a signal's stop (it saves
  already), not ``KeyboardInterrupt`` (a Ctrl+C is a stop the user asked for), not a
  failure before the first step (nothing trained), not a step already saved.
* **Which state**: the live model, optimizers, schedulers and scaler are those of the last
  finished step as long as no ``optimizer.step()`` began since its boundary
  (``guard.update_began``); the RNG streams and the data position are the boundary's
  (``guard.boundary_capture``, ``engine/boundary.py``), since the failing step may have
  drawn from them and fetched its batch. Otherwise nothing is saved, said in the
  ``failure_saved`` event. (The rewind guard's in-memory snapshot is not used: it holds
  no RNG streams nor the full data position, so a checkpoint of it would not resume
  bitwise.)
* **Never long, never a hang**: every rank's part is bounded by ``timeout_s`` (the
  whole save runs in a daemon thread joined with that limit; past it the write is
  cancelled within a piece). With several ranks the save is the usual multi-rank commit
  under keys of its own: each rank writes its files (RNG streams, data position) into the
  step's temp directory and publishes their records; rank 0, which holds the replicated
  model and optimizer, commits with the records it has by the limit (a rank that has not
  begun within 10 s, a dead one, is not waited for). A rank whose files
  are missing (dead, stuck with no thread able to write, or past the step) makes the
  checkpoint **incomplete**: committed with ``failure.missing`` naming those ranks, and
  never resumed from (``manifest.incomplete``: ``resume="auto"`` skips it, saying why). If
  rank 0 is the dead or stuck one, nothing is committed (its state is the replicated
  copy written here).
* Under torchrun a worker's exit makes the agent SIGTERM the others and SIGKILL them
  30 s later; guardrails holds SIGTERM while a failing rank reports, so the ranks other
  than 0 wait for rank 0's commit (up to the limit) before they exit, and the default
  limit, 20 s, ends inside that window.

On CUDA, a save from the watchdog's thread would copy the weights off a device whose
stream may be stuck in a collective (the copy would wait for it): it is not attempted
there (said), only from the main thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guardrails._errors import CheckpointError
from guardrails.checkpoint import commit
from guardrails.checkpoint.manifest import (
    ManifestError,
    incomplete,
    list_checkpoints,
    read_manifest,
    resume_order,
)
from guardrails.distributed.store import stretched, wait_keys
from guardrails.guards.checkpointer.signals import SignalCapture
from guardrails.guards.checkpointer.writer import CheckpointWriter
from guardrails.util import files as _perms

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

log = logging.getLogger("guardrails.checkpoint")

#: How often rank 0 reads the counters of the other ranks' records (stretched with N).
_POLL_S = 0.05

#: How long one rank waits for another to begin its failure save. Ranks that fail
#: together on one verdict begin within ~1 s of each other, but a rank stuck in a sleep
#: or a C call learns of a peer's failure only at its watchdog's next poll (1 s), gives a
#: failure raised everywhere a beat (3 s) and its main thread ``abort_after_s`` (2 s)
#: before its thread saves: 6.7 s was seen on a loaded 2-core host with 4 ranks, where 3 s
#: left the hang's save incomplete. Rank 0 stops waiting for a rank that has not begun by
#: then (dead: a SIGKILLed peer cost the whole 20 s limit before); a rank other than 0
#: that failed alone leaves, and rank 0 commits its part once it fails in turn.
_BEGUN_WAIT_S = 10.0


class FailureSave:
    """One guard's failure save (see the module docstring), built at its start.
    ``writer``: the checkpointer's (its directory, the run record); the ranks commit
    through the checkpoint's side store. ``capture``: its signals (a signal's stop is
    not a failure). ``timeout_s``: the most one rank spends on it."""

    def __init__(
        self, guard: Guard, writer: CheckpointWriter, capture: SignalCapture, *, timeout_s: float
    ) -> None:
        self._writer = writer
        self._capture = capture
        self._store = guard.side_store("checkpoint")  # None in a single process
        self._rank, self._world = guard.rank, guard.world_size
        self.timeout_s = timeout_s
        #: What the save did: ``None`` until it ran, then the ``failure_saved`` event's fields.
        self.outcome: dict[str, Any] | None = None
        #: This rank (not 0) wrote its part and left before rank 0 began to commit.
        self.part_only = False

    def wanted(self, guard: Guard, error: BaseException | None, *, stop: int | None) -> bool:
        """Whether ``error`` ending the run calls for a failure save: an ``Exception``
        (not a stop: ``SystemExit``, ``KeyboardInterrupt``; not a save's own
        ``CheckpointError``), after at least one step, not one already saved, and not
        when a signal ended the run (``stop``: the step a signal's stop was decided at;
        a signal that came after a verdict, torchrun's teardown once the stuck rank
        exited, does not count)."""
        if self.outcome is not None or not isinstance(error, Exception) or stop is not None:
            return False
        if isinstance(error, CheckpointError):  # a save failed: another would fail alike
            return False
        if guard.step == 0 or guard.step == self._writer.last_saved_step:
            return False  # a failure at start (nothing trained), or a step saved already
        return not self._capture.received or self._capture.verdict_first(guard)

    def run(self, guard: Guard, error: BaseException, *, from_thread: bool) -> None:
        """Save, bounded by ``timeout_s``, then the ``failure_saved`` event. Never raises:
        the run's own error is what the process reports."""
        t0 = time.perf_counter()
        cause = _cause(error)
        state, why = self._state(guard, from_thread=from_thread)
        path: Path | None = None
        missing: list[int] = []
        # A rank with nothing to save still says so, or rank 0 would wait out the limit.
        if state is not None or self._store is not None:
            result: dict[str, Any] = {"why": why}
            cancel = threading.Event()
            # A dead rank the error names (RankFailedError) is not waited for.
            dead = getattr(error, "failed_rank", None)
            worker = threading.Thread(
                target=self._save_safely,
                args=(guard, state, cause, cancel, result, dead),
                name="guardrails-failure-save",
                daemon=True,
            )
            worker.start()
            worker.join(self.timeout_s + 1.0)  # its waits end by the limit; +1 s to commit
            if worker.is_alive():
                cancel.set()
                why = f"the save did not finish within failure_save_timeout_s={self.timeout_s:g} s"
            else:
                path, missing, why = result.get("path"), result.get("missing", []), result["why"]
                if not why and path is None and not self.part_only:
                    why = "rank 0 did not commit it"
        if path is not None:  # committed in the local tier (local_directory): copied now
            left = self.timeout_s - (time.perf_counter() - t0)
            self._writer.drain(guard, guard.step, path, within_s=left)
        self._said(guard, cause, path, missing, why, time.perf_counter() - t0)

    def _state(self, guard: Guard, *, from_thread: bool) -> tuple[Any, str]:
        """``((rng, position), "")``: the boundary's RNG streams and data position, when
        the live state is the last finished step's; else ``(None, why not)``."""
        if guard.update_began:
            return None, (
                "the failure came inside optimizer.step() or after it, before the next "
                "step boundary: the live weights are no longer those of a finished step"
            )
        if (
            from_thread
            and guard.device is not None
            and guard.device.type == "cuda"
            and self._writer.stages_weights
        ):  # the other ranks' parts are host-side: the boundary's RNG and data position
            return None, (
                "the main thread is stuck and the weights are on a GPU whose stream may be "
                "stuck with it (a copy would wait for it)"
            )
        capture = guard.boundary_capture
        rng, why = capture.rng_at_boundary()
        if rng is None:
            return None, why
        if capture.epoch != guard.epoch:
            return None, "the failing step began a new pass over the loader"
        pos = guard.data_position
        return (rng, (capture.trained_at, [*guard.step_batches, *pos.fetched])), ""

    def _save_safely(
        self,
        guard: Guard,
        state: Any,
        cause: str,
        cancel: threading.Event,
        result: dict,
        dead: int | None,
    ) -> None:
        try:
            if state is None:  # said where the others wait: nothing comes from this rank
                self._say_none(guard.step, result["why"])
                return
            result["path"], result["missing"] = self._save(guard, state, cause, cancel, dead)
        except Exception as e:  # said in the event; the run's own error goes on
            log.debug("guardrails: the failure save failed", exc_info=True)
            result["why"] = f"the save failed: {type(e).__name__}: {e}"

    def _say_none(self, step: int, why: str) -> None:
        """This rank has no consistent state to save: its record says so (rank 0's
        commit too: nothing is committed without the replicated state)."""
        said = json.dumps({"none": why})
        key = f"{self._writer.token}/failure/{step}"
        self._store.set(f"{key}/files/{self._rank}", said)
        if self._rank == 0:
            self._store.set(f"{key}/commit", said)
        else:
            self._store.add(f"{key}/filed", 1)

    def _save(
        self, guard: Guard, state: Any, cause: str, cancel: threading.Event, dead: int | None
    ) -> tuple[Path | None, list[int]]:
        """This rank's files, then (rank 0) the commit with every record in by the
        limit: ``(path or None, the ranks missing)``."""
        deadline = time.monotonic() + self.timeout_s
        writer, step = self._writer, guard.step
        key = f"{writer.token}/failure/{step}"
        rng, position = state
        if self._store is not None:  # rank 0 waits for this rank's part from now on
            self._store.set(f"{key}/begun/{self._rank}", "1")
            if self._rank != 0:
                self._store.add(f"{key}/begun", 1)
        part = writer.stage_boundary(guard, rng=rng, position=position)
        part.cancel = cancel
        if self._rank == 0:
            _perms.make_dirs(writer.root)
        tmp = commit.begin(writer.root, step, f"{writer.token}-failure")
        files: dict[str, Any] = {}
        try:
            part.write(tmp, files)
            if self._store is None:
                return self._commit(step, tmp, files, cause, missing=[]), []
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing was committed: no trace left
            raise
        self._store.set(f"{key}/files/{self._rank}", json.dumps(files))
        if self._rank != 0:
            self._store.add(f"{key}/filed", 1)
            return self._await_commit(key, deadline, dead), []
        merged, missing = self._gather(key, deadline, dead)
        merged.update(files)  # rank 0's own
        try:
            final = self._commit(step, tmp, merged, cause, missing=missing)
        except BaseException as e:
            self._store.set(f"{key}/commit", json.dumps({"error": repr(e)}))
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._store.set(f"{key}/commit", json.dumps({"path": str(final)}))
        return final, missing

    def _gather(
        self, key: str, deadline: float, dead: int | None
    ) -> tuple[dict[str, Any], list[int]]:
        """Rank 0: the other ranks' records in by ``deadline`` (``dead``: not waited
        for; nor a rank that has not begun its failure save within
        :data:`_BEGUN_WAIT_S`), merged, and the ranks without one (or with nothing to
        save). While it waits it reads two counters a poll, not a key per rank (the poll
        stretched with N: 10,000 ranks' records polled every 50 ms would be 200,000
        calls a second, twice what one store serves); the records are read once."""
        store, world = self._store, self._world
        others = [r for r in range(1, world) if r != dead]
        begun_by = time.monotonic() + _BEGUN_WAIT_S
        poll_s = stretched(_POLL_S, world)
        while time.monotonic() < deadline:
            filed = int(store.add(f"{key}/filed", 0))
            if filed >= len(others):
                break
            # Past the wait for beginners: stop once everyone who began has filed.
            if time.monotonic() > begun_by and int(store.add(f"{key}/begun", 0)) <= filed:
                break
            time.sleep(poll_s)
        merged: dict[str, Any] = {}
        missing = [] if dead is None or dead == 0 else [dead]
        for r in others:
            if not store.check([f"{key}/files/{r}"]):
                missing.append(r)  # dead, stuck, or waiting in a collective for rank 0
                continue
            got = json.loads(store.get(f"{key}/files/{r}"))
            if "none" in got:
                missing.append(r)
            merged.update({k: v for k, v in got.items() if k != "none"})
        return merged, sorted(missing)

    def _await_commit(self, key: str, deadline: float, dead: int | None) -> Path | None:
        """A rank other than 0: rank 0's commit, waited for until ``deadline`` once rank
        0 has begun its failure save (this rank's exit would get it SIGTERMed by torchrun
        mid-commit); not when rank 0 is the ``dead`` one, nor when it has not begun
        within :data:`_BEGUN_WAIT_S` (it may be waiting in a collective for this rank,
        and will commit this rank's part when this rank's exit fails it). Blocking waits
        on a store client of their own (``wait_keys``): no poll, whatever N."""
        if dead == 0:
            return None
        store, commit_key = self._store, f"{key}/commit"
        first_s = max(0.0, min(_BEGUN_WAIT_S, deadline - time.monotonic()))
        try:
            wait_keys(store, [commit_key], timedelta(seconds=first_s), world=self._world)
        except TimeoutError:
            if not store.check([f"{key}/begun/0"]):
                self.part_only = True
                return None
            left_s = max(0.0, deadline - time.monotonic())
            try:
                wait_keys(store, [commit_key], timedelta(seconds=left_s), world=self._world)
            except TimeoutError:
                return None
        said = json.loads(store.get(commit_key))
        return Path(said["path"]) if "path" in said else None

    def _commit(
        self, step: int, tmp: Path, files: dict[str, Any], cause: str, *, missing: list[int]
    ) -> Path:
        """Rank 0's commit of the failure save: never counted by retention (an
        incomplete one must not retire a complete checkpoint)."""
        ranks = [r for r in range(self._world) if r not in missing]
        return commit.commit(
            self._writer.root,
            step,
            tmp,
            files,
            world_size=self._world,
            ranks=ranks,
            keep_last=None,
            failure={"cause": cause, "state": "live", "missing": missing},
            **self._writer.commit_args,
        )

    def _latest_text(self, ours: Path | None) -> str:
        """Which checkpoint a re-run resumes, in words: the newest complete one on disk
        (a background save may have committed it without this rank hearing so yet)."""
        with contextlib.suppress(OSError):
            for step, ckpt in resume_order(list_checkpoints(self._writer.root)):
                with contextlib.suppress(ManifestError):
                    if ckpt != ours and incomplete(ckpt, read_manifest(ckpt)) is None:
                        return (
                            f"a re-run resumes the latest complete checkpoint, {ckpt} (step {step})"
                        )
        return "no complete checkpoint is left, so a re-run starts from scratch"

    def _said(
        self,
        guard: Guard,
        cause: str,
        path: Path | None,
        missing: list[int],
        why: str,
        took_s: float,
    ) -> None:
        """The ``failure_saved`` event (a warning: the console says it). Its message
        names the error's class only: the error's own report follows, and its headline
        said twice would be noise (the ``cause`` field has its first line)."""
        step, kind = guard.step, cause.split(":", 1)[0]
        if path is not None and not missing:
            message = (
                f"the run failed in step {step + 1} ({kind}); the state of step {step}, the "
                f"last finished step, was saved to {path} in {took_s:.1f} s: run the same "
                "command to continue from it (resume='auto')."
            )
        elif path is not None:
            message = (
                f"the run failed in step {step + 1} ({kind}); step {step} was saved to {path} "
                f"without rank(s) {missing} (dead or stuck: their RNG streams and data "
                "position are missing), so it is incomplete and resume='auto' will not "
                f"use it; {self._latest_text(path)}."
            )
        elif self.part_only:
            why = "rank 0 had not begun its failure save"
            message = (
                f"the run failed in step {step + 1} ({kind}); this rank wrote its part of the "
                f"failure save of step {step} (its RNG streams and data position), which rank "
                "0 commits once it fails too."
            )
        else:
            message = (
                f"the run failed in step {step + 1} ({kind}); nothing was saved: {why}; "
                f"{self._latest_text(path)}."
            )
        self.outcome = {
            "cause": cause,
            "path": None if path is None else str(path),
            "step": step,
            "seconds": round(took_s, 3),
            "state": "live" if path is not None or self.part_only else "none",
            "why": why,
            "complete": path is not None and not missing,
            "missing": missing,
        }
        with contextlib.suppress(Exception):  # the events file gone: the error goes on
            guard.event("failure_saved", level="warning", message=message, **self.outcome)


#: The most of an error's first line the manifest and the event keep (gloo's run to 300).
_CAUSE_CHARS = 160


def _cause(error: BaseException) -> str:
    """The error's class and first line: what the manifest and the event say."""
    first = str(error).splitlines()[0] if str(error) else ""
    if len(first) > _CAUSE_CHARS:
        first = first[: _CAUSE_CHARS - 3] + "..."
    return f"{type(error).__name__}: {first}" if first else type(error).__name__
