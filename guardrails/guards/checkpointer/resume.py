"""Resume orchestration for :class:`SignalCheckpointer`: which checkpoint (rank 0 picks and
verifies, every rank loads the same), the run's config checked against the saved one,
what is announced.

:class:`ResumeAtStart` is built with the resume knobs and the checkpoint directory; at
the guard's start :meth:`~ResumeAtStart.at_start` finds, checks and applies a
checkpoint and returns what the writer continues from (:class:`Resumed`); at a normal
end :meth:`~ResumeAtStart.finish` marks the last checkpoint finished.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guardrails._errors import CheckpointError, GuardrailsError, ResumeError
from guardrails.checkpoint import commit, manifest, read, restore, tier
from guardrails.engine import data as _data
from guardrails.engine import ddp_buckets, model
from guardrails.metrics.events import read_events, to_console

if TYPE_CHECKING:
    from torch import Tensor

    from guardrails.engine.guard import Guard


_ABSENT = "(absent)"


def _same(a: Any, b: Any) -> bool:
    """Equal as settings: NaN equals NaN, 1 equals 1.0, but True is not 1."""
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _show(value: Any, n: int = 40) -> str:
    """A value in a message: its repr, cut to ``n`` characters."""
    text = _ABSENT if value is _ABSENT else repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def _changes(changed: Mapping[str, tuple[Any, Any]], n: int = 8) -> str:
    """``lr: 0.1 -> 0.05; batch_size: 32 -> 64`` for the first ``n`` changed keys."""
    items = [f"{k}: {_show(old)} -> {_show(new)}" for k, (old, new) in changed.items()]
    return "; ".join(items[:n]) + (f"; ... {len(items) - n} more" if len(items) > n else "")


def _ago(when: float) -> str:
    """``"3 min ago, at 2025-06-01 12:03"``: how long ago, and the local time."""
    seconds = max(0.0, time.time() - when)
    if seconds < 90:
        age = f"{seconds:.0f} s"
    elif seconds < 90 * 60:
        age = f"{seconds / 60:.0f} min"
    elif seconds < 36 * 3600:
        age = f"{seconds / 3600:.0f} h"
    else:
        age = f"{seconds / 86400:.0f} days"
    return f"{age} ago, at {time.strftime('%Y-%m-%d %H:%M', time.localtime(when))}"


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a resume restored: its directory and step, the id of the run
    that saved it (``None``: saved before run ids), when that run had finished, and the
    seconds the resume took (picked, checked, applied: ``report``'s restart load)."""

    path: Path
    step: int
    run_id: str | None
    finished_at: float | None
    load_s: float = 0.0


class ResumeAtStart:
    """Finds, checks and applies a checkpoint at the guard's start.

    ``resume``, ``allow_world_size_change``, ``allow_config_change``: the knobs (see
    :class:`SignalCheckpointer.Config`). ``root``: the checkpoint directory;
    ``directory``: the knob it came from (``None``: ``run_dir/checkpoints``), for the
    way out a message names. ``local``: the node-local tier's directory (``None``:
    none); ``resume="auto"`` looks in both (``tier.candidates``).
    """

    def __init__(
        self,
        *,
        resume: str | PathLike[str] | None,
        root: Path,
        local: Path | None = None,
        directory: Path | None,
        allow_world_size_change: bool,
        allow_config_change: bool | Sequence[str],
    ) -> None:
        self.resume = resume
        self.root = root
        self.local = local
        self.directory = directory
        self.allow_world_size_change = allow_world_size_change
        self.allow_config_change = allow_config_change
        #: What this guard resumed from (``None``: it started fresh).
        self.resumed: Resumed | None = None

    def _prepare(self, guard: Guard, ckpt: Path) -> restore.Plan:
        """``restore.prepare`` for the guard (everything read and checked, nothing
        applied), with the data position checked against this run's loader; its
        ``ResumeError`` says how to fix it in ``guard()``'s terms (``guard()`` has no
        ``strict`` and takes every optimizer and scheduler it guards), and names the way
        out when this is another run: a run_dir of its own."""
        try:
            return restore.prepare(
                ckpt,
                model.unwrap(guard.model),
                guard.optimizers,
                scheduler=guard.schedulers or None,
                scaler=guard.scaler,
                allow_world_size_change=self.allow_world_size_change,
                check=lambda state, f: _data.check_position(guard.loader, state.get("data"), f),
                # g.state's tensors saved from rank 0's GPU go to this rank's.
                extras_device=None if guard.device.type == "cpu" else guard.device,
            )
        except ResumeError as e:
            remedy = getattr(e, "remedy", None)
            fresh = f"or, if this is another run, {self._new_run(guard)}. Nothing was modified."
            if remedy == "strict":
                raise e.rehint(
                    "build the model with the same architecture and config that was saved; "
                    "to load only the matching part (a backbone under a new head), call "
                    f"guardrails.resume('{ckpt}', model, strict=False) before the guard and "
                    "pass guard(..., resume=None); " + fresh
                ) from None
            if remedy == "no_model":
                raise e.rehint(
                    "its manifest lists no model file, so there is no model to resume: "
                    "resume from an older step_* directory (guard(..., resume=...)), or "
                    "start fresh with resume=None; " + fresh
                ) from None
            if remedy == "no_optimizer":
                raise e.rehint(
                    "build the optimizer over the same parameters, in the same order and "
                    "param groups, as the run that saved it; to restart the optimizer from "
                    f"scratch, call guardrails.resume('{ckpt}', model) before the guard and "
                    "pass guard(..., resume=None); " + fresh
                ) from None
            if remedy is not None and remedy.startswith("no_"):
                what = remedy[3:]
                raise e.rehint(
                    f"the checkpoint holds no {what}: resume it without one (leave "
                    f"{what}= out of guard(...)), or call guardrails.resume('{ckpt}', "
                    f"model, optimizer, strict=False) before the guard and pass "
                    "guard(..., resume=None); " + fresh
                ) from None
            if remedy == "world_size":
                raise e.rehint(
                    f"relaunch with {e.saved_world} rank(s) for an exact resume; or pass "
                    "guard(..., checkpoint={'allow_world_size_change': True}) to restore "
                    "the replicated state and start the interrupted pass over; " + fresh
                ) from None
            if e.hint is not None and "run_dir" not in e.hint:
                hint = e.hint.removesuffix(" Nothing was modified.")
                raise e.rehint(f"{hint} {fresh}") from None
            raise

    def _new_run(self, guard: Guard) -> str:
        """The way out when the checkpoints found belong to another run: where this one
        should go instead, in the terms the user set it with."""
        if self.directory is not None:
            return (
                "give this run a checkpoint directory of its own "
                f"(guard(checkpoint={{'directory': ...}})), or move {self.root} away"
            )
        return (
            "give this run a run_dir of its own (guard(run_dir=...); your script's "
            f"--run-dir option, if it has one), or move {self.root} away"
        )

    def at_start(self, guard: Guard, run: Mapping[str, Any]) -> Resumed | None:
        """Resume ``guard`` from the checkpoint its ``resume`` knob names, if any:
        rank 0 picks and verifies it, every rank checks its config (``run``: this run's
        record, config and optimizer settings as the code built them) and its own files,
        then everything is applied (``guard.resume_from``) and the resume announced.
        ``None`` when there is nothing to resume."""
        began = time.monotonic()
        chosen, plan = self._choose(guard)
        if not chosen:
            return None
        ckpt = Path(chosen)
        # Checked before anything is restored, on every rank (the same manifest, and the
        # preflight has compared the ranks' configs): a refusal leaves all as it was.
        saved = restore.saved_run(ckpt)
        changed = self._check_config(guard, ckpt, saved, run)
        settings = _settings_changed(saved, run)
        if plan is None:  # the other ranks: their own files of the checkpoint rank 0 chose
            try:
                plan = self._prepare(guard, ckpt)
            except CheckpointError as e:
                raise e.rehint(read.skip_hint(ckpt)) from None
        # The components' own state first: their load_state_dict is theirs (a custom
        # component's may refuse a well-formed dict), and a refusal must leave the
        # model, optimizers, schedulers, scaler and RNG as they were.
        _check_generators(guard, ckpt, plan.rank_tensors)  # set back by resume_from
        _load_components(guard, ckpt, plan.rank_state.get("components", {}))
        with guard.quiet():  # a sharded load may step the optimizer to create its state
            out = restore.apply(plan)
        rank_state, tensors = out["rank_state"], out["rank_tensors"]
        # DDP reduces the next step in the buckets the saved run had: bitwise, as that run
        ddp_buckets.restore_everywhere(
            guard.model, rank_state.get("ddp_buckets"), store=guard.side_store("checkpoint"),
            rank=guard.rank, world=guard.world_size,
        )  # fmt: skip
        position = rank_state.get("data")
        if position is not None and "loader" in rank_state:  # format 2 kept it beside
            position = {**position, "loader": rank_state["loader"]}
        guard.resume_from(out["step"], state=out["extras"], position=position, tensors=tensors)
        # The same run, continued: its checkpoints keep the run's id (retention counts
        # them together).
        self.resumed = Resumed(
            path=Path(out["path"]),
            step=out["step"],
            run_id=saved["id"] if isinstance(saved.get("id"), str) else None,
            finished_at=saved.get("finished_at"),
            load_s=time.monotonic() - began,
        )
        self._announce(guard, saved, changed, settings, out.get("recreated_groups") or [])
        return self.resumed

    def _choose(self, guard: Guard) -> tuple[str | None, restore.Plan | None]:
        """Which checkpoint every rank resumes (``""``: none yet, a fresh run): rank 0
        picks and verifies it (its plan, prepared, comes with it) and says it through
        the store; the other ranks read rank 0's word."""
        auto = self.resume == "auto"
        where = self.root if auto else Path(self.resume)  # type: ignore[arg-type]
        store = guard.side_store("checkpoint")
        if guard.rank != 0:
            assert store is not None
            got = json.loads(store.get("resume"))
            if "error" in got:
                raise ResumeError(
                    f"rank 0 could not pick a checkpoint to resume from: {got['error']}",
                    rank=guard.rank,
                    path=str(where),
                )
            if not got["path"]:
                return "", None  # a fresh run
            return str(_on_this_node(Path(got["path"]), self.root, self.local)), None
        chosen: str | None = None
        plan: restore.Plan | None = None
        try:
            found_ckpts = [c for _, c in tier.candidates(where, self.local)] if auto else []
            if auto and not found_ckpts:
                chosen = ""  # nothing saved yet: a fresh run
                self._warn_finished_unsaved(guard)
            elif auto and manifest.only_incomplete(found_ckpts):
                # A rank died before the run's first complete checkpoint: the survivors'
                # failure save lacks its RNG streams and data position. Nothing else
                # was ever saved, so the run starts over, as it would have without it.
                chosen = ""
                self._say_only_incomplete(guard, found_ckpts)
            else:
                # Rank 0 reads and checks each candidate, newest first, against this
                # run (its model, optimizers, loader): a damaged one is skipped, said
                # in an event, and the previous one is tried.
                found, plan, skipped = restore.pick(
                    where, lambda c: self._prepare(guard, c), local=self.local if auto else None
                )
                chosen = str(found)
                _say_skipped(guard, where, found, skipped)
        except GuardrailsError as e:
            if store is not None:
                store.set("resume", json.dumps({"error": str(e)}))
            if auto and getattr(e, "remedy", None) == "all_invalid":
                e.rehint(
                    "every checkpoint under the run's checkpoint directory is invalid; "
                    "restore them from a backup, pass resume=None to start fresh (they "
                    "are kept), or resume= a specific checkpoint; if this is another "
                    f"run, {self._new_run(guard)}."
                )
            raise
        if store is not None:
            store.set("resume", json.dumps({"path": chosen}))
        return chosen, plan

    def _check_config(
        self, guard: Guard, ckpt: Path, saved: Mapping[str, Any], run: Mapping[str, Any]
    ) -> dict[str, tuple[Any, Any]]:
        """The config keys that differ from the checkpoint's, ``key -> (saved, given)``;
        a ``ResumeError`` unless ``allow_config_change`` allows them all."""
        old, new = saved.get("config"), run.get("config")
        if old is None or new is None:  # saved without one, or none given: nothing to compare
            return {}
        changed = {
            key: (old.get(key, _ABSENT), new.get(key, _ABSENT))
            for key in [*new, *(k for k in old if k not in new)]
            if not (key in old and key in new and _same(old[key], new[key]))
        }
        allow = self.allow_config_change
        refused = {
            key: values
            for key, values in changed.items()
            if not (
                allow is True or (allow and any(key == k or key.startswith(f"{k}.") for k in allow))
            )
        }
        if not refused:
            return changed
        raise ResumeError(
            f"{ckpt} was saved by a run with another config ({len(refused)} setting(s) "
            f"differ: {_changes(refused)}): resuming it would continue that run's weights "
            "and optimizer state under the new settings",
            step=int(saved["step"]),
            path=str(ckpt),
            changed=refused,
            hint=f"if this is a new run, {self._new_run(guard)}; the same command then "
            "starts fresh. To continue that run with the new settings, pass "
            "guard(..., checkpoint={'allow_config_change': True}), or a list of the keys "
            f"that may change ({list(refused)[:3]}). Nothing was modified.",
        )

    def _announce(
        self,
        guard: Guard,
        saved: Mapping[str, Any],
        changed: Mapping[str, tuple[Any, Any]],
        settings: list[str],
        recreated: list[str],
    ) -> None:
        """Say the resume on the console (rank 0) and in the events: which checkpoint,
        its step and age, a config continued despite changes, a finished run; and the
        optimizer settings the resume put back over the code's."""
        assert self.resumed is not None
        path, saved_at, finished = self.resumed.path, saved.get("time"), self.resumed.finished_at
        text = f"resumed from {path} (step {self.resumed.step}"
        if isinstance(saved_at, (int, float)) and finished is None:
            text += f", saved {_ago(saved_at)}"
        text += ")"
        if finished is not None:
            text += f": the end of a run that finished {_ago(finished)}; this run continues past it"
        if changed:
            text += f", with a changed config (allow_config_change): {_changes(changed)}"
        if recreated:  # optimizer.add_param_group during the saved run (an unfrozen layer)
            text += (
                f"; the optimizer's param {'groups' if len(recreated) > 1 else 'group'} "
                f"added during that run re-created: {', '.join(recreated)}"
            )
        if finished is not None:
            text += f". If this is a new run, {self._new_run(guard)}"
        guard.event(
            "resumed",
            message=text,
            path=str(path),
            saved_at=saved_at,
            finished_at=finished,
            config_changed=list(changed) or None,
            recreated_groups=recreated or None,
            load_s=round(self.resumed.load_s, 6),
        )
        if guard.rank == 0:
            to_console(f"guardrails: {text}")
        if settings and guard.rank == 0:
            base = (
                "; for lr, the scheduler's base_lrs[i] too: it sets each group's lr from "
                "them at its next step"
                if guard.schedulers
                else ""
            )
            guard.event(
                "optimizer_settings_changed",
                level="warning",
                message=f"the optimizer settings in your code differ from those of the "
                f"run that saved {path}, and the resume restored the "
                f"checkpoint's (an optimizer's state_dict holds its settings): "
                f"{'; '.join(settings)}. The checkpoint's values are used now. To train "
                "with the code's, set them after the guard has started "
                f"(optimizer.param_groups[i]['lr'] = ...{base}); if this is a new run, "
                f"{self._new_run(guard)}.",
                settings=settings,
            )

    def trained_nothing(self, guard: Guard, last: Path | None) -> bool:
        """At a normal end: whether this run resumed a finished run and trained no step
        (said, on rank 0; ``last``: the latest checkpoint). Then there is nothing to
        mark finished."""
        done = self.resumed
        if done is None or done.finished_at is None or guard.step != done.step:
            return False
        if guard.rank == 0:
            guard.event(
                "nothing_trained",
                level="warning",
                message=f"this run trained no step: it resumed {last} "
                f"(step {guard.step}), the end of a run that finished "
                f"{_ago(done.finished_at)}, and its loop ended at once (the "
                "script's own end, its step or epoch count, was reached already). "
                f"If this is a new run, {self._new_run(guard)}; to train further, raise "
                "the script's step or epoch count.",
            )
        return True

    def mark_finished(self, guard: Guard, last: Path | None) -> None:
        """The run ended normally: mark the checkpoint it ended with (``last``, the
        latest committed) as finished, so a re-run of the same command says it resumes
        a finished run. Rank 0, and only a checkpoint of this step in this run's
        directory."""
        if (
            guard.rank != 0
            or last is None
            or last.name != f"step_{guard.step:09d}"
            or last.resolve().parent  # not a checkpoint of another run
            not in {self.root.resolve(), *([self.local.resolve()] if self.local else [])}
        ):
            return
        try:
            now = time.time()
            for copy in {last, self.root / last.name}:  # both tiers' copies (rank 0's node)
                if copy.is_dir():
                    commit.mark_finished(copy, now)
        except (OSError, GuardrailsError) as e:  # the run itself is done and saved
            guard.event(
                "checkpoint_unmarked",
                level="warning",
                message=f"could not record in {last} that the run finished ({e}): a re-run "
                "of this command resumes it without saying that the run had finished.",
            )

    def _say_only_incomplete(self, guard: Guard, ckpts: list[Path]) -> None:
        """``resume="auto"`` found only incomplete failure saves: a fresh start, said."""
        names = ", ".join(c.name for c in ckpts[-3:])
        guard.event(
            "resume_skipped_incomplete",
            level="warning",
            message=f"the only checkpoint(s) in {ckpts[0].parent} ({names}) "
            "are incomplete failure saves (a rank died or was stuck and could not write its RNG "
            "streams and data position): this run starts from step 0. To lose less when a "
            "rank dies, save periodically too: guard(checkpoint={'every_s': 1800}).",
            paths=[str(c) for c in ckpts],
        )

    def _warn_finished_unsaved(self, guard: Guard) -> None:
        """``resume="auto"`` finds no checkpoint, but the run directory's events say the
        last run in it ended cleanly: it finished without saving (no periodic saves, so
        nothing saved its end), and this run trains again from step 0 beside it. Said at
        once, naming the finished run's step and how to make a re-run resume as
        finished. Reads the last 64 KiB of each events file, once."""
        last = _last_run_end(guard.run_dir, guard.run_id)
        if last is None or last.get("error") is not None or not last.get("step"):
            return
        guard.event(
            "finished_run_not_saved",
            level="warning",
            message=f"{guard.run_dir} holds a run that finished at step {last['step']} and "
            "saved no checkpoint (periodic saves were off, so its end was not saved "
            "either): this run trains again from step 0, a second run in the same "
            "directory. To make the same command resume a finished run as finished (and "
            "do nothing more), save periodically: guard(..., checkpoint={'every_n_steps': "
            "N}) also saves the run's end. For a new experiment, use a new run_dir.",
            finished_step=last["step"],
        )

    def warn_beside_checkpoints(
        self, guard: Guard, *, periodic: bool, keep_last: int | None
    ) -> None:
        """``resume=None`` with periodic saves into a directory that holds another run's
        checkpoints: the two runs are kept apart (run ids), but the directory now holds
        both, and ``resume="auto"`` will continue this one, not the other."""
        if guard.rank != 0 or not periodic:
            return
        found = manifest.list_checkpoints(self.root)
        if not found:
            return
        newest = found[-1][1]
        kept = (
            f"keep_last={keep_last} counts only this run's checkpoints (the other "
            "run's stay, and keep their disk space); "
            if keep_last is not None
            else ""
        )
        guard.event(
            "fresh_run_beside_checkpoints",
            level="warning",
            message=f"resume=None: this run starts fresh, but {self.root} holds another "
            f"run's checkpoints (up to {newest.name}), and this run's saves go beside "
            f"them, kept apart: {kept}a later resume='auto' continues the run that saved "
            f"last (this one, once it has saved), so the other run is continued only by "
            f"naming its checkpoint (resume='{newest}'). To keep the runs in separate "
            f"directories, {self._new_run(guard)} first.",
        )


def _on_this_node(chosen: Path, root: Path, local: Path | None) -> Path:
    """The copy of rank 0's ``chosen`` checkpoint this rank reads: a copy in the
    local tier that this rank's node lacks is read from the durable directory (the
    same bytes: the drain copies them unchanged, and this rank verifies its files)."""
    if local is not None and chosen.parent == local and not chosen.is_dir():
        return root / chosen.name
    return chosen


def _say_skipped(guard: Guard, where: Path, found: Path, skipped: list[tuple[str, str]]) -> None:
    """The damaged checkpoints rank 0 skipped to resume from ``found``, said as
    warnings (one for each, or one for them all)."""
    reasons = dict(skipped)
    for name, said in restore.said_skipped(skipped, where):
        away = name or "them"
        guard.event(
            "checkpoint_invalid",
            level="warning",
            message=f"{said}; resuming from {found.name} instead (delete "
            f"or move {away} away to keep this from being said at every "
            "start)",
            checkpoint=name,
            reason=reasons.get(name) if name else said,
            using=str(found),
            count=1 if name else len(skipped),
        )


def _check_generators(guard: Guard, ckpt: Path, tensors: Mapping[str, Tensor]) -> None:
    """The states this rank's part of ``ckpt`` holds for the loop's generators
    (``guard(generators=...)``), checked before anything is applied: a state of another
    size is another kind of generator's (a CUDA one's for a CPU one). A generator the
    checkpoint lacks (passed since it was saved) keeps its state, with a warning."""
    for name, gen in guard.generators.items():
        state = tensors.get(f"generator.{name}")
        if state is None:
            guard.event(
                "generator_not_in_checkpoint",
                level="warning",
                message=f"the generator {name!r} passed to guard(generators=...) is not in "
                f"{ckpt.name} (saved before it was passed): it keeps the state it has now, "
                "so what the loop draws from it differs from the run this one continues.",
                generator=name,
            )
            continue
        live = gen.get_state()
        if state.dtype != live.dtype or state.shape != live.shape:
            raise ResumeError(
                f"{ckpt}: the state saved for generator {name!r} ({state.numel()} bytes) "
                f"is not one of this run's generator {name!r} ({live.numel()} bytes, on "
                f"{gen.device}): it was saved for another kind of generator",
                path=str(ckpt),
                field=f"generator.{name}",
                hint="pass the generator the run was saved with under that name "
                "(guard(generators={...})); or start fresh with resume=None. Nothing was "
                "modified.",
            )


def _last_run_end(run_dir: Path, run_id: str) -> dict[str, Any] | None:
    """The ``end`` event of the last run in ``run_dir`` (rank 0's, whichever node it
    ran on: the last 64 KiB of each node's events file, merged by time), before this
    run (``run_id``); ``None`` when that run has none (killed, or its start is all that
    is left in those bytes) or nothing can be read."""
    for event in reversed(read_events(run_dir, tail_bytes=65536)):
        if event.get("rank") != 0:
            continue
        if event.get("kind") == "end":
            return event
        if event.get("kind") == "start" and event.get("run") != run_id:
            return None  # that run has no end: it did not finish
    return None


def _load_components(guard: Guard, ckpt: Path, saved: Mapping[str, Any]) -> None:
    """Each component's saved state into it, before anything else is restored: a
    ``ResumeError`` naming the component if its ``load_state_dict`` raises."""
    for c in guard.components:
        if c.name not in saved:
            continue
        try:
            c.load_state_dict(saved[c.name])
        except Exception as e:
            raise ResumeError(
                f"component {c.name!r} ({type(c).__name__}) could not load its state "
                f"from {ckpt}: {type(e).__name__}: {e}; nothing else was restored "
                "(model, optimizers, schedulers, scaler and RNG are as they were)",
                rank=guard.rank,
                path=str(ckpt),
                hint=f"fix {type(c).__name__}.load_state_dict for the state its "
                "state_dict() saved, or resume with a run_dir of its own to start fresh",
            ) from e


def _settings_changed(saved: Mapping[str, Any], run: Mapping[str, Any]) -> list[str]:
    """Each optimizer setting the code now builds differently from the run that saved
    the checkpoint (both as built, before any step or resume: a scheduler's moves
    of ``lr`` are not a change), as ``"group 0 lr: checkpoint 0.1, code 0.05"``."""
    old = saved.get("optimizer_settings") or {}
    new = run["optimizer_settings"]
    if not old:  # saved before settings were recorded
        return []
    lone = len(new) == 1 and len(old) == 1
    found = []
    for name, groups in new.items():
        was = next(iter(old.values())) if lone else old.get(name)
        if was is None or len(was) != len(groups):  # the load names a real mismatch
            continue
        who = "" if len(new) == 1 else f"optimizer {name!r} "
        for i, (before, now) in enumerate(zip(was, groups, strict=True)):
            for key, value in now.items():
                # Keys one torch version has and another lacks are not settings
                # the user changed.
                if key in before and not _same(before[key], value):
                    found.append(
                        f"{who}group {i} {key}: checkpoint {_show(before[key])}, "
                        f"code {_show(value)}"
                    )
    return found
