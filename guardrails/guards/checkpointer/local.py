"""The checkpointer's node-local tier (``checkpoint/tier.py``) for one guard: built at
start (every rank on one host? room for a checkpoint?), and the drain of each local
commit into the durable directory, told in events.

:func:`build_tier` is called once at the guard's start, on every rank (its checks go
through the store, so every rank gets the same answer); :class:`Drain` is owned by the
writer and runs after each of rank 0's local commits: in the writer thread for a
periodic save, and for a signal's save for as long as the grace period leaves.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guardrails._errors import CheckpointError
from guardrails.checkpoint import stage
from guardrails.checkpoint.digest import Cancelled
from guardrails.checkpoint.tier import LocalTier, estimate_bytes, size
from guardrails.distributed import store as _store
from guardrails.engine import model
from guardrails.util import storage

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

log = logging.getLogger("guardrails.checkpoint")


def build_tier(
    guard: Guard, local_directory: Path | None, local_keep_last: int, knobs: Any, store: Any
) -> LocalTier | None:
    """The local tier of this guard's saves, or ``None`` (no ``local_directory``, or
    ranks on several hosts: said once). ``knobs``: the checkpointer (its ``root``, the
    durable directory, and ``keep_last``); ``store``: its side store (``None`` in a
    single process). Raises a :class:`CheckpointError` on every rank when the local
    directory cannot hold one checkpoint (rank 0 measures it)."""
    durable: Path = knobs.root
    if local_directory is None:
        return None
    world = guard.world_size
    host = socket.gethostname()
    if store is not None and not _store.same_everywhere(store, "tier-host", host, world=world):
        if guard.rank == 0:
            guard.event(
                "checkpoint_local_tier_off",
                level="warning",
                message=f"local_directory={str(local_directory)!r} is not used: the ranks "
                "run on several hosts, and a node-local directory would hold only its own "
                f"ranks' files. Saves go straight to {durable}, as without it.",
            )
        return None
    tier = LocalTier(
        local=local_directory,
        durable=durable,
        keep_last=local_keep_last,
        durable_keep_last=knobs.keep_last,
    )
    refused: CheckpointError | None = None
    if guard.rank == 0:
        refused = _check_room(guard, tier)
        if store is not None:
            store.set("tier-room", json.dumps({"error": None if refused is None else str(refused)}))
    if store is not None and guard.rank != 0:
        said = json.loads(store.get("tier-room"))["error"]
        if said is not None:
            refused = CheckpointError(f"rank 0: {said}", path=str(local_directory))
    if refused is not None:
        raise refused
    return tier


def _check_room(guard: Guard, tier: LocalTier) -> CheckpointError | None:
    """Rank 0: the local directory measured against one checkpoint of this run; the
    error to raise when it cannot hold one, a warning when it holds fewer than
    ``local_keep_last`` plus the one being written."""
    bare = model.unwrap(guard.model)
    need = estimate_bytes(bare.state_dict(), [stage.per_rank(o) for o in guard.optimizers.values()])
    try:
        room = tier.room(need)
        tier.refuse_if_too_small(room)
    except CheckpointError as e:
        return e
    except OSError as e:
        return CheckpointError(
            f"the checkpoint's local directory {tier.local} cannot be used: {e}",
            path=str(tier.local),
            hint=storage.fix_for(e, tier.local, run_dir=False) + ".",
        )
    wanted = tier.keep_last + 1  # retention retires the oldest after the next commits
    if room.copies < wanted:
        guard.event(
            "checkpoint_local_tier_small",
            level="warning",
            message=f"the checkpoint's local directory {tier.local} has room for "
            f"{room.copies} checkpoint(s) of about {size(room.need_bytes)}, and "
            f"local_keep_last={tier.keep_last} needs {wanted} while a save is written: "
            "a save may fail there for want of space (training goes on, the previous "
            "checkpoint stays the latest). Lower local_keep_last or use a larger disk.",
            free_bytes=room.free_bytes,
            need_bytes=room.need_bytes,
        )
    return None


class Drain:
    """Copies each of rank 0's local commits into the durable directory and says how
    it went. ``tier``: the local tier; ``token``: the guard's temp-directory name;
    ``grace_s``: the launcher's grace period (a signal's save drains within it)."""

    def __init__(self, tier: LocalTier, *, token: str, grace_s: float) -> None:
        self.tier = tier
        self._token = token
        self._grace_s = grace_s
        self._failed = 0
        #: The step of the last checkpoint copied to the durable directory.
        self.drained_step = -1

    def after_commit(
        self,
        guard: Guard,
        step: int,
        final: Path,
        *,
        run: dict[str, Any],
        adopt_unlabelled: bool,
        cancel: threading.Event,
        within_s: float | None,
    ) -> None:
        """Drain ``final`` (``step``, committed in the local tier): at once in this
        thread, or, ``within_s`` given (a signal's save), in a thread waited for that
        long, after which the checkpoint is said to live on this node only."""
        args = (guard, step, final, run.get("id"), adopt_unlabelled, cancel)
        if within_s is None:
            self._drain(*args, delete_old=True)
            return
        thread = threading.Thread(
            target=self._drain,
            args=args,
            kwargs={"delete_old": False},  # the next start empties the trash
            name="guardrails-checkpoint-drain",
            daemon=True,  # the process exits when the grace period is spent
        )
        thread.start()
        thread.join(max(0.0, within_s))
        if thread.is_alive():
            cancel.set()
            guard.event(
                "checkpoint_local_only",
                level="warning",
                step=step,
                path=str(final),
                host=socket.gethostname(),
                message=f"the checkpoint of step {step} is committed on this node only "
                f"({socket.gethostname()}: {final}): its copy to {self.tier.durable} did "
                f"not finish in the {max(0.0, within_s):.1f} s left for it before the "
                "process ends (the grace period, or failure_save_timeout_s). A restart on "
                "this node resumes it; a restart on another node resumes the newest "
                "checkpoint in the durable directory. To copy it in time: raise grace_s "
                "and ask the scheduler for an earlier warning (SLURM: --signal=USR1@120).",
            )

    def _drain(
        self,
        guard: Guard,
        step: int,
        final: Path,
        run_id: str | None,
        adopt: bool,
        cancel: threading.Event,
        *,
        delete_old: bool,
    ) -> None:
        t0 = time.perf_counter()
        try:
            durable = self.tier.drain(
                final,
                token=self._token,
                run_id=run_id,
                adopt_unlabelled=adopt,
                cancel=cancel,
                delete_old=delete_old,
            )
        except Cancelled:  # a newer save's, or the grace period's end: said by them
            log.info("guardrails: the copy of %s to %s was abandoned", final, self.tier.durable)
            return
        except Exception as e:  # the local commit stands: said, not raised
            self._failed += 1
            cause = storage.cause_of(e, self.tier.durable) or type(e).__name__
            guard.event(
                "checkpoint_drain_failed",
                level="warning" if self._failed == 1 else "info",
                step=step,
                path=str(final),
                message=f"the checkpoint of step {step} is committed on this node "
                f"({socket.gethostname()}: {final}) but could not be copied to "
                f"{self.tier.durable}: {cause}: "
                f"{e}. A restart on this node resumes it; elsewhere, the newest durable "
                "checkpoint. The next save's copy retries.",
            )
            return
        self.drained_step = step
        guard.event(
            "checkpoint_drained",
            step=step,
            path=str(durable),
            local=str(final),
            seconds=round(time.perf_counter() - t0, 3),
        )
