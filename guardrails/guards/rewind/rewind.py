"""Rewind: on a divergence or a streak of non-finite steps, go back to a state taken
before the trouble began, skip past its batches, and train on.

What large-model teams do by hand after a loss spike (restart from a checkpoint ~100
steps back, skip a few hundred batches, lower the LR for a while), done by the guard,
opt-in (``guard(rewind=True)``); off, it is not installed at all.

* **Snapshots**: every ``snapshot_every_steps`` steps, at a step boundary, the model,
  optimizers, schedulers and scaler are copied to host memory (``snapshot.py``: the
  checkpointer's staging blocks, pinned on a GPU machine; no host-device sync), into
  the older of two slots, so the newest two are kept: the trouble is found late (a
  divergence ~20 steps after it began, a GPU's flags one interval late), and the
  newest snapshot may be after it began. The first one is taken at the first step.
* **The trouble**: NanGuard asks for a rewind (``request``) at a streak of
  ``max_consecutive_skips`` skipped non-finite steps, instead of raising
  :class:`~guardrails.NonFiniteError`, and at a ``divergence``, beside its warning.
  Granted while fewer than ``max_rewinds`` rewinds were made and a snapshot older
  than the trouble's first step is held; otherwise today's behaviour (the error, the
  warning).
* **Never back onto the damage**: a snapshot of step k holds step k's update, so the
  trouble's first step is the first sign of it: NanGuard lowers it to an LR jump
  shortly before (whose update may be the damage), and a rewind that landed on a
  snapshot and sees trouble again before a newer one is taken goes back further
  (:meth:`Rewind._limit`) rather than onto the same damage again.
* **The rewind**, at the next step boundary: the newest snapshot taken before the
  trouble began is put back (none old enough: the newest of this run's checkpoints
  from before it, checked whole by ``restore.prepare`` before anything is touched,
  rank 0 choosing it for every rank), ``g.step`` goes back to its step (the update count of the
  weights now held, so the scheduler and the weights agree), every component forgets
  the steps after it (``Component.on_rewind``), and the loader is *not* rewound: the
  run goes on from the loader's current position, so every batch since the snapshot
  is skipped, and ``skip_batches`` more are fetched and dropped (counted in the data
  position, so a checkpoint saved after a rewind resumes exactly). The process's RNG
  streams and ``g.state`` go on too (a loop that draws its batches from torch's RNG,
  like nanoGPT's, would otherwise draw the skipped batches again). With
  ``lr_scale``, every param group's LR is scaled for ``lr_warmup_steps`` steps,
  rising linearly back to 1: set in each step just before the optimizer's update and
  put back right after it, so it works whether a scheduler or the loop sets the LR.
  A ``rewind`` event says what happened, what was skipped and the LR.
* **Ranks agree**: a streak of non-finite steps is seen by every rank at the same step
  (NanGuard's flags agree), so every rank rewinds at that step's boundary, with no
  exchange. A divergence is judged on each rank's own loss, so one rank may see it
  alone: it posts the trouble's first step in the job's store under the key of the
  first snapshot step at least two steps ahead, and every rank reads that key at that
  step's boundary (one store call per rank per snapshot, none per step; several
  posts for one step keep the earliest start). Not the checkpointer's time-paced
  stop agreement: its next check can be hundreds of steps away on a fast loop (725
  measured on the tests' loop: the snapshot needed was replaced by then), and the step
  it falls on depends on timing. At a snapshot step, the rewind comes from the same
  posts and the same snapshots on every rank, so a re-run with the same faults rewinds
  at the same step, bitwise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guardrails._errors import GuardrailsError
from guardrails.checkpoint import manifest, restore
from guardrails.distributed import store as _store
from guardrails.engine import model
from guardrails.engine.component import Component
from guardrails.engine.config import configure
from guardrails.guards.rewind.snapshot import Snapshot
from guardrails.util.checks import positive_int

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

logger = logging.getLogger("guardrails.rewind")

#: Snapshots kept: the newest may be after the trouble began (found late), so one more.
KEEP = 2


class Rewind(Component):
    """Rolls every rank back to an in-memory snapshot taken before a divergence or a
    streak of non-finite steps, skips past the batches of the trouble and trains on.
    Off by default: ``guardrails.guard(..., rewind=True)`` or a dict of the knobs of
    :class:`Rewind.Config`."""

    @dataclass(kw_only=True)
    class Config:
        """Rewind's knobs (the section is off unless given: ``guard(rewind=True)``).

        Attributes:
            snapshot_every_steps: copy the model, optimizers, schedulers and scaler to
                host memory every this many steps (and at the first step); the newest
                two are kept, so a rewind goes back at most twice this many steps. Keep
                it above how late the trouble is found (a divergence: NanGuard's
                ``divergence_steps`` + ``check_every_n_steps``, ~30 steps; a streak of
                non-finite steps: ``max_consecutive_skips``, plus
                ``2 * check_every_n_steps`` on a GPU), or no snapshot is old enough.
                Each snapshot costs the state's size in host memory (two of them
                held), and a copy of it (see docs/performance.md). Default 50.
            max_rewinds: rewind at most this many times per run (counted across a
                resume); the trouble after that gets today's behaviour (the
                :class:`~guardrails.NonFiniteError`, the divergence warning). Default 3.
            skip_batches: after a rewind, fetch and drop this many more batches (past
                the trouble's batches, which the rewind skips already: the loader is
                not rewound). Default 0.
            lr_scale: after a rewind, scale every param group's learning rate by this
                factor at the first step, rising linearly back to 1 over
                ``lr_warmup_steps`` steps. 1.0: unchanged. Default 1.0.
            lr_warmup_steps: the steps over which the LR comes back from ``lr_scale``
                (> 0 when ``lr_scale`` < 1). Default 100.
        """

        snapshot_every_steps: int = 50
        max_rewinds: int = 3
        skip_batches: int = 0
        lr_scale: float = 1.0
        lr_warmup_steps: int = 100

        def __post_init__(self) -> None:
            positive_int("snapshot_every_steps", self.snapshot_every_steps)
            positive_int("max_rewinds", self.max_rewinds)
            for knob in ("skip_batches", "lr_warmup_steps"):
                value = getattr(self, knob)
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ValueError(f"{knob} must be an int >= 0, got {value!r}")
            scale = self.lr_scale
            if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not 0 < scale <= 1:
                raise ValueError(
                    f"lr_scale must be a factor in (0, 1] (the LR after a rewind, as a "
                    f"share of the run's), got {scale!r}"
                )
            self.lr_scale = float(scale)
            if self.lr_scale < 1 and self.lr_warmup_steps == 0:
                raise ValueError(
                    f"lr_scale={self.lr_scale:g} scales the LR for lr_warmup_steps steps "
                    "after a rewind, and lr_warmup_steps is 0: give it the steps over "
                    "which the LR comes back (e.g. lr_warmup_steps=100), or leave lr_scale "
                    "at 1.0"
                )

    name = "rewind"
    #: Its boundary must come at the same step on every rank (benchmark mode never
    #: bypasses it), and a skipped streak's request arrives before its after_step.
    essential = True
    after = ("nan",)
    # Before the checkpointer: a save at the boundary of a rewind is of the state it
    # put back (and it resumes after this one's state is loaded).
    before = ("checkpoint",)
    #: The section is off unless given (``guard(rewind=True)``).
    section_default = False

    def __init__(self, config: Rewind.Config | None = None, /, **knobs: Any) -> None:
        configure(self, config, knobs)
        #: Rewinds made this run (counted across a resume): the ``rewind`` events' fields.
        self.rewinds: list[dict[str, Any]] = []
        #: Rewinds made, counted across a resume (what ``max_rewinds`` caps).
        self.used = 0
        self._slots: list[Snapshot] = []
        self._taken = False  # the first snapshot (at the first step) is taken
        self._prepared = False  # the slots' memory is being allocated ahead
        # The rewind to make at the next boundary: (cause, start, numbers, rank).
        self._due: tuple[str, int, dict[str, Any], int] | None = None
        # This rank's request posted for the other ranks (a divergence under several
        # ranks): (cause, start, numbers, the snapshot step it is read at).
        self._wanted: tuple[str, int, dict[str, Any], int] | None = None
        # The job's store for the posts (side_store("rewind")), None in one process.
        self._store: Any = None
        # Checkpoints a rewind could not use (damaged, another model), and those it
        # went back to once: not tried again. Issue 52: a forged checkpoint that loads
        # diverges again, and the next rewind went back into it.
        self._refused: set[str] = set()
        # The snapshot step the last rewind went back to (-1: none): trouble seen again
        # before a newer snapshot is taken means that one holds it (see _limit).
        self._landed = -1
        self._warmup_left = 0  # steps of LR scaling still to come
        self._warmup_done = 0
        self._saved_lrs: list[tuple[dict[str, Any], Any]] = []

    # ------------------------------------------------------------------ lifecycle

    def on_start(self, guard: Guard) -> None:
        self._guard = guard
        if model.is_sharded(model.unwrap(guard.model)):
            raise ValueError(
                "guard(rewind=...) snapshots the model's full state on every rank; a "
                "sharded model (FSDP2) is not supported yet: leave rewind off, or "
                "rely on checkpoints (guard(checkpoint={'every_n_steps': ...}))."
            )
        self._store = guard.side_store("rewind")
        pinned = guard.device.type == "cuda"
        self._slots = [Snapshot(pinned) for _ in range(KEEP)]
        guard.shared.rewind = self

    def on_end(self, guard: Guard, exc: BaseException | None) -> None:
        guard.shared.rewind = None
        self._slots = []  # the host memory goes with them

    def state_dict(self) -> dict[str, Any]:
        """The rewinds made (the cap counts across a resume) and the LR warm-up still
        to come; snapshots are not saved (a resumed run takes its own)."""
        wanted = self._wanted
        return {
            "used": self.used,
            "warmup_left": self._warmup_left,
            "warmup_done": self._warmup_done,
            # A resume at the rewind's step takes its first snapshot of that same step.
            "landed": self._landed,
            # A post not read yet (a save between a rank's post and the snapshot step
            # that reads it): posted again at resume, under the same key.
            "wanted": None
            if wanted is None
            else [
                wanted[0],
                wanted[1],
                {k: v for k, v in wanted[2].items() if _plain(v)},
                wanted[3],
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.used = int(state.get("used", 0))
        self._warmup_left = int(state.get("warmup_left", 0))
        self._warmup_done = int(state.get("warmup_done", 0))
        self._landed = int(state.get("landed", -1))
        wanted = state.get("wanted")
        if wanted and self._store is not None:
            cause, start, numbers, at = wanted
            self._post(cause, int(start), numbers, at=int(at))

    # ------------------------------------------------------------------ services

    def request(self, cause: str, start: int, numbers: dict[str, Any], *, everywhere: bool) -> bool:
        """The rewind guard's service (``engine/services.RewindService``, at
        ``guard.shared.rewind``), asked by NanGuard: trouble began at step ``start``
        (``cause``: ``"nonfinite"``, a streak of skipped steps; ``"divergence"``);
        ``numbers``: its evidence, for the event. ``everywhere``: every rank sees the
        same trouble at this same step (then every rank rewinds at the next boundary, no
        exchange); else this rank alone may (its request is posted for the next snapshot
        step, see :meth:`_post`). Returns whether a rewind is coming (``False``: the cap
        is reached, or no snapshot is older than ``start``: the caller keeps today's
        behaviour)."""
        if self.used >= self.max_rewinds:
            return False
        start = self._limit(start)
        if self._target(start) is None and self._on_disk(start) is None:
            return False
        if self._due is not None or self._wanted is not None:
            return True  # one is coming already
        if everywhere or self._store is None:
            self._due = (cause, start, numbers, self._guard.rank)
        else:
            self._post(cause, start, numbers)
        return True

    def _post(
        self, cause: str, start: int, numbers: dict[str, Any], *, at: int | None = None
    ) -> None:
        """This rank alone saw the trouble: post it under the key of the first snapshot
        step at least two steps ahead, which every rank reads at that step's boundary
        (:meth:`_decision`). Two ahead: a rank reads there once past that step's
        collectives, which this rank joins only after this post (DDP's all-reduce
        keeps the ranks within a step of each other). Several ranks posting for one
        step keep the earliest start (compare-and-set), so the outcome does not depend
        on which rank wrote first. A few store calls, once."""
        if at is None:
            every = self.snapshot_every_steps
            at = -(-(self._guard.step + 2) // every) * every
        key, mine = self._key(at), str(start)
        value = bytes(self._store.compare_set(key, "", mine)).decode()
        while value not in (mine, "-") and int(value) > start:
            value = bytes(self._store.compare_set(key, value, mine)).decode()
        self._wanted = (cause, start, numbers, at)

    def _key(self, at: int) -> str:
        # The rewinds so far prefix it: after one, step numbers repeat.
        return f"{self.used}/{at}"

    def _decision(self, guard: Guard) -> None:
        """At a snapshot step's boundary, on every rank: the earliest start any rank
        posted for this step, if one did (then a rewind, now). One store call."""
        step = guard.step
        with guard.in_phase("agree"):
            value = bytes(self._store.compare_set(self._key(step), "", "-")).decode()
        mine = self._wanted
        if mine is not None and mine[3] == step:
            self._wanted = None
        else:
            mine = None
        if value == "-":
            return
        start = int(value)
        if mine is not None and mine[1] == start:
            self._due = (mine[0], start, mine[2], guard.rank)
        else:  # another rank's (this rank may have posted a later start)
            self._due = ("divergence", start, {}, -1)

    # ------------------------------------------------------------------ per step

    def before_step(self, guard: Guard) -> None:
        if not self._taken:  # the first step's weights, before its update
            self._taken = True
            fetched = guard.batch_in_epoch - len(guard.step_batches)
            self._take(guard, (guard.epoch, max(0, fetched)))
        if self._warmup_left:
            self._scale_lrs(guard.optimizer)

    def after_step(self, guard: Guard) -> None:
        if self._warmup_left:
            self._put_lrs_back()
            self._warmup_left -= 1
            self._warmup_done += 1

    def before_extra_step(self, guard: Guard, name: str) -> None:
        if self._warmup_left:  # another optimizer's step (a GAN's): scaled the same
            self._scale_lrs(guard.optimizers[name])

    def after_extra_step(self, guard: Guard, name: str) -> None:
        self._put_lrs_back()

    def on_boundary(self, guard: Guard) -> None:
        if not self._prepared:  # the first boundary: the optimizer's state exists now
            self._prepared = True
            for slot in self._slots:
                slot.prepare(guard)
        if guard.step % self.snapshot_every_steps:
            if self._due is not None:  # seen by every rank at this step: no exchange
                self._rewind(guard)
            return
        # A snapshot step: first the rewind a rank posted for it, or one due here, then
        # the snapshot (so the one a rewind goes back to is never replaced before it).
        if self._store is not None and self._due is None:
            self._decision(guard)
        if self._due is not None:
            self._rewind(guard)
        step = guard.step
        if step % self.snapshot_every_steps == 0 and not any(s.step == step for s in self._slots):
            self._take(guard, (guard.epoch, guard.batch_in_epoch))

    # ------------------------------------------------------------------ helpers

    def _take(self, guard: Guard, position: tuple[int, int]) -> None:
        """A snapshot of now into the slot holding the oldest (or none)."""
        slot = min(self._slots, key=lambda s: s.step)
        slot.take(guard, position)

    def _limit(self, start: int) -> int:
        """The step a rewind must go back to before, for trouble that showed at step
        ``start``: ``start`` itself, unless the last rewind went back to a snapshot and
        the trouble showed again before a newer one was taken: then that snapshot holds
        it already (its own step's update did the damage: an LR jump, a bad update), and
        going back to it again would repeat the same trouble; the rewind goes further
        back. The same on every rank (the rewinds and the snapshots are)."""
        landed = self._landed
        if landed >= 0 and start > landed and not any(s.step > landed for s in self._slots):
            return landed
        return start

    def _target(self, start: int) -> Snapshot | None:
        """The newest snapshot taken before step ``start`` began (its step < start)."""
        older = [s for s in self._slots if 0 <= s.step < start]
        return max(older, key=lambda s: s.step) if older else None

    def _on_disk(self, start: int) -> Path | None:
        """The fallback when no snapshot is older than step ``start``: the newest of
        this run's checkpoints (the checkpointer's periodic saves) from before it that
        passes the checks a resume applies (``restore.problem``: no link, every byte
        hashed, every file's content), not refused or used already; ``None`` if none."""
        ck = self._guard.component("checkpoint")
        run = getattr(ck, "run_id", None)
        if ck is None or not run:
            return None
        root = ck.config.directory or self._guard.run_dir / "checkpoints"  # type: ignore[attr-defined]
        for step, path in reversed(manifest.list_checkpoints(root)):
            if step >= start or str(path) in self._refused or not path.name.startswith("step_"):
                continue
            try:
                if restore.saved_run(path).get("id") != run:
                    continue
                problem = restore.problem(path)
            except Exception:  # an unreadable manifest, a newer format: not this one
                continue
            if problem is None:
                return path
            self._refused.add(str(path))
            self._guard.event("rewind_checkpoint_invalid", level="warning", message=problem)
        return None

    def _agreed_checkpoint(self, guard: Guard, start: int) -> Path | None:
        """Every rank goes back to the same checkpoint: rank 0 picks it and posts it,
        the others wait for its word (one store call or two each, at a rewind only)."""
        if self._store is None:
            return self._on_disk(start)
        key = f"disk/{self._key(guard.step)}"
        if guard.rank == 0:
            path = self._on_disk(start)
            self._store.set(key, "" if path is None else str(path))
            return path
        with guard.in_phase("agree"):
            _store.wait_keys(self._store, [key], timedelta(seconds=600), world=guard.world_size)
            got = bytes(self._store.get(key)).decode()
        return Path(got) if got else None

    def _restore_checkpoint(self, guard: Guard, path: Path) -> tuple[int, tuple[int, int] | None]:
        """Put the model, optimizers, schedulers and scaler back from ``path``, checked
        whole first (``restore.prepare``: nothing is touched unless all of it fits),
        without its RNG streams, data position or components' state (they go on, as
        after a snapshot). Returns its step and the loader's position it was saved at."""
        plan = restore.prepare(
            path,
            model.unwrap(guard.model),
            guard.optimizers,
            scheduler=guard.schedulers or None,
            scaler=guard.scaler,
        )
        data = plan.rank_state.get("data") or {}
        plan.rng, plan.rank_tensors = None, {}
        with guard.quiet():
            restore.apply(plan)
        at = (int(data["epoch"]), int(data["batch_in_epoch"])) if "epoch" in data else None
        return plan.step, at

    def _scale_lrs(self, opt: Any) -> None:
        """This step's LR scale (from ``lr_scale`` at the first step after a rewind,
        linearly back to 1), applied to every param group of ``opt`` until its update
        is done (:meth:`_put_lrs_back`, right after it)."""
        share = self._warmup_done / self.lr_warmup_steps
        factor = self.lr_scale + (1.0 - self.lr_scale) * share
        saved = self._saved_lrs
        for group in opt.param_groups:
            lr = group.get("lr")
            if lr is None:
                continue
            saved.append((group, lr))
            group["lr"] = lr * factor

    def _put_lrs_back(self) -> None:
        for group, lr in self._saved_lrs:
            group["lr"] = lr
        self._saved_lrs = []

    def _rewind(self, guard: Guard) -> None:
        cause, start, numbers, rank = self._due  # type: ignore[misc]
        self._due = None
        self._wanted = None
        start = self._limit(start)
        snap = self._target(start)
        from_step = guard.step
        at = (guard.epoch, guard.batch_in_epoch)
        source, position = "memory", None
        if snap is not None:
            snap.restore(guard)
            to_step, position = snap.step, snap.position
        else:  # no snapshot from before it: a checkpoint from before it, if one
            path = self._agreed_checkpoint(guard, start)
            why = "no checkpoint of this run from before it either"
            to_step = -1
            if path is not None:
                self._refused.add(str(path))  # used once: never twice (see _refused)
                try:
                    to_step, position = self._restore_checkpoint(guard, path)
                    source = str(path)
                except GuardrailsError as e:  # checked before anything was touched
                    why = f"the checkpoint from before it, {path}, could not be used: {e}"
            if to_step < 0:
                oldest = min(s.step for s in self._slots)
                guard.event(
                    "rewind_failed",
                    level="warning",
                    message=(
                        f"a rewind before step {start} ({cause}) was due, but no snapshot "
                        f"from before it is held (the oldest is of step {oldest}) and {why}: "
                        "training goes on. Take snapshots less often (snapshot_every_steps) "
                        "so that one reaches back further, or save checkpoints "
                        "(checkpoint={'every_n_steps': ...})."
                    ),
                    start=start,
                    cause=cause,
                )
                return
        self._landed = to_step if source == "memory" else -1
        guard.drop_batches(self.skip_batches)
        guard.rewind_to(to_step)
        for s in self._slots:  # of the trajectory just left behind
            if s.step > to_step:
                s.step = -1
        self.used += 1
        scaled = self.lr_warmup_steps if self.lr_scale < 1 else 0
        self._warmup_left, self._warmup_done = scaled, 0
        self._saved_lrs = []
        skipped = {
            "steps": from_step - to_step,
            "from": None if position is None else list(position),
            "to": list(at),
            "dropped": self.skip_batches,
        }
        who = "" if rank == guard.rank or cause == "nonfinite" else " (seen by another rank)"
        what = {
            "nonfinite": f"{numbers.get('skipped', '?')} non-finite steps in a row from step "
            f"{start}",
            "divergence": f"a divergence from step {start}{who}",
        }.get(cause, f"{cause} from step {start}")
        detail = numbers.get("detail")
        lr = (
            f"the LR is scaled by {self.lr_scale:g} for the next step, back to 1 over "
            f"{scaled} steps"
            if scaled
            else "the LR is unchanged"
        )
        drop = f", and the next {self.skip_batches} dropped" if self.skip_batches else ""
        message = (
            f"rewound from step {from_step} to step {to_step} after {what}"
            + (f" ({detail})" if detail else "")
            + f": {_held(guard)} back at step {to_step} "
            + ("(an in-memory snapshot)" if source == "memory" else f"(checkpoint {source})")
            + f", the {from_step - to_step} steps' batches since ("
            + (
                f"epoch {position[0]} batch {position[1] + 1}"
                if position is not None
                else f"step {to_step}"
            )
            + f" to epoch {at[0]} batch {at[1]}) are skipped{drop}; {lr}. Rewind "
            f"{self.used} of max_rewinds={self.max_rewinds}."
        )
        fields = {
            "cause": cause,
            "start": start,
            "from_step": from_step,
            "to_step": to_step,
            "source": source,
            "batches_skipped": skipped,
            "lr_scale": self.lr_scale if scaled else 1.0,
            "lr_warmup_steps": scaled,
            "rewinds": self.used,
            "max_rewinds": self.max_rewinds,
            "requested_by": rank,
            "trouble": {k: v for k, v in numbers.items() if _plain(v)},
        }
        self.rewinds.append({"step": to_step, **fields})
        guard.event("rewind", level="warning", message=message, step=to_step, **fields)


def _held(guard: Guard) -> str:
    """What a rewind put back, in words: ``the model and optimizer are``..."""
    parts = ["model", "optimizers" if len(guard.optimizers) > 1 else "optimizer"]
    if guard.schedulers:
        parts.append("schedulers" if len(guard.schedulers) > 1 else "scheduler")
    if guard.scaler is not None:
        parts.append("scaler")
    return "the " + ", ".join(parts[:-1]) + " and " + parts[-1] + " are"


def _plain(value: Any) -> bool:
    """A value an event can hold as it is (JSON numbers, strings, lists of them)."""
    if isinstance(value, (int, float, str, bool)) or value is None:
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return False
