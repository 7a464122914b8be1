"""What the guard object ``g`` offers, in two sets: the user's and the components'.

A ``Guard`` is two things at once. To a training loop it is a handful of calls and
readings (``g.step``, ``g.save_checkpoint()``, ``g.pause_watchdog("eval")``...): the
**user surface**, documented in docs/usage.md ("What `g` offers your loop"), shown by
``dir(g)`` and tab completion (``Guard.__dir__``), and kept stable. To a component it is
also the engine: the published step state it reads (``StepState``'s fields) and the
**services** it calls to change something (``request_stop``, ``skip_update``...; see
ARCHITECTURE.md, "The step state"). Those stay public attributes, because every guard
uses them, but they are for components: a loop that needs one is a component.

Every public name of a started ``Guard`` is in exactly one of the two sets, and the
docs page lists exactly the user surface (``tests/test_api.py``): a new public name on
``Guard`` is a decision about which set it joins.
"""

from __future__ import annotations

#: What a training loop calls or reads on ``g``, sorted (like ``__all__``).
USER_SURFACE: tuple[str, ...] = (
    "clip_grad_norm_",  # clip and share the norm with the guard: one pass, not two
    "close",  # end the guard without ``with`` (removes every hook)
    "component",  # one component by name: g.component("nan")
    "components",  # the components running, in order
    "epoch",  # passes over the loader so far (restored at resume)
    "observe",  # give the guard the step's loss when it cannot find it
    "pause_watchdog",  # with g.pause_watchdog("eval"): a long, legitimate pause
    "phase",  # where the loop is: data, forward, backward, optimizer, loop
    "run_dir",  # where metrics, events and checkpoints go
    "save_checkpoint",  # save now, on every rank at the same step
    "start",  # start the guard without ``with``
    "state",  # your own dict, saved in every checkpoint and restored at resume
    "step",  # optimizer steps so far (restored at resume)
    "stopping",  # why the loop ended early (a signal with exit_on_signal=False)
)

#: What components call or read: the engine's services and its published state
#: (engine/state.py), sorted. For components; a loop does not need them.
SERVICES: tuple[str, ...] = (
    "auditor",
    "backward_s",
    "batch_in_epoch",
    "benchmark",
    "bf16_autocast",
    "boundary_capture",
    "clip_norm_steps",
    "collective",
    "data_position",
    "data_wait_s",
    "device",
    "device_phases",
    "die",
    "drop_batches",
    "event",
    "events",
    "exhausted_at",
    "exit_code",
    "fail_from_thread",
    "forward_compiled",
    "forward_s",
    "fp16_autocast",
    "gc_total_s",
    "generation",
    "generator_states",
    "generators",
    "grad_norm",
    "graph_grad_norm",
    "in_phase",
    "loader",
    "lr",
    "model",
    "models",
    "news",
    "nonfinite_buffers",
    "open_row",
    "optimizer",
    "optimizer_s",
    "optimizers",
    "params",
    "paused",
    "quiet",
    "rank",
    "record_skip",
    "replace_error",
    "replay_fn",
    "replaying",
    "request_stop",
    "restored_buffers",
    "restored_buffers_of",
    "resume_from",
    "rewind_to",
    "run_id",
    "running",
    "scaler",
    "scheduler",
    "schedulers",
    "shared",
    "side_group",
    "side_store",
    "skip_cause",
    "skip_scaler",
    "skip_update",
    "skipped",
    "step_batches",
    "step_calls",
    "step_loss",
    "step_ring",
    "step_row",
    "step_time_s",
    "tokens",
    "tokens_per_batch",
    "total_norm",
    "update_began",
    "verdict_at",
    "world_size",
    "wrap_batches",
)
