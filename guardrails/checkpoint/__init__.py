"""Checkpoints that are complete, atomic and verified, and the exact resume that reads them.

A resumed run silently loses whatever the checkpoint left out: the optimizer moments,
the LR schedule position, the loss scale, the RNG streams (so dropout and shuffling
differ, and the run cannot be reproduced), and, worst, the checkpoint itself when the
job was killed halfway through ``torch.save``. This folder is the on-disk format:

* ``stage.py``: tensors copied off the live objects into one reusable staging buffer,
  written as safetensors and JSON (:class:`~guardrails.checkpoint.stage.Part`);
* ``commit.py``: the atomic commit, the manifest's records, retention, and
  :func:`guardrails.save_checkpoint`;
* ``read.py``: every file read and checked against the object it loads into;
* ``restore.py``: :func:`guardrails.resume`, which checks everything before it applies
  anything;
* ``manifest.py`` (no torch: ``inspect`` uses it), ``digest.py`` (files hashed as
  written), ``sharded.py`` (FSDP2 / DTensor state in DCP's format), ``codec.py`` and
  ``common.py`` (what both sides share).

Signals, periodic and background saves and the multi-rank commit's orchestration are
the :class:`~guardrails.SignalCheckpointer`'s (``guards/checkpointer/``); the
data-loader position is the engine's (``engine/data.py``).

The format (``format_version`` 4; formats 1 to 3 still read), one directory per
committed step::

    root/
      step_000001200/
        model.safetensors       model.state_dict(); each storage once, tied keys recorded
                                as aliases in the header metadata ("guardrails.aliases")
        optimizer.safetensors   every tensor of optimizer.state_dict(), keyed
                                "<param_idx>.<name>" (e.g. "3.exp_avg")
        optimizer.json          param_groups and the non-tensor state, tensors referenced
                                as {"__tensor__": "3.exp_avg"}, and the shapes of the
                                parameters the state was saved for
        optimizer.<name>.*      the same, per optimizer, when the guard has several
        scheduler.json          scheduler.state_dict() (scheduler.pt when not JSON-able;
                                scheduler.<name>.* when several)
        scaler.json             GradScaler.state_dict()
        extras.json             the caller's extras (g.state), JSON values, tensors
                                referenced as {"__tensor__": "extras.best", "device":
                                "cuda:0"} (the device when not the CPU)
        extras.safetensors      the extras' tensors, when they hold any
        rank00000.json          each rank's own state: python and numpy RNG, the data
        rank00000.safetensors   position, the guard's state, DDP's rebuilt buckets
                                ("ddp_buckets", given back at resume:
                                engine/ddp_buckets.py); torch CPU and CUDA RNG
        rank00001.* ...         (one pair per rank)
        rank00000.optimizer.*   optimizer state that differs per rank (a
                                ZeroRedundancyOptimizer's shard), one set per rank
        dcp/                    sharded model and optimizer state, written by every rank
                                through torch.distributed.checkpoint (instead of
                                model.safetensors and optimizer.*)
        manifest.json           written LAST: bytes and sha256 of every file above (a
                                file over 64 MiB: the sha256 of its 64 MiB pieces'
                                sha256 digests, "sha256_chunk_bytes" says so), step,
                                time, versions, world size and ranks; "contents" (each
                                optimizer's and scheduler's file stem, whether it was
                                saved per rank, and their classes, checked before
                                anything is applied at resume); "run" (the run's config
                                and its optimizers' settings as the code built them,
                                and "finished_at" once the run ended normally: see
                                :func:`run_record`); and "manifest_sha256", the
                                manifest's hash of itself
      step_000001300/ ...

What each format added: 2 moved the RNG streams from ``rng.json`` / ``rng.safetensors``
(rank 0's only) into the per-rank ``rank<R>.*`` files; 3 added several optimizers and
schedulers, optimizer state saved per rank, the parameter shapes, and ``contents``; 4
hashes a file over 64 MiB in pieces (``sha256_chunk_bytes``: written and verified by
several threads at disk speed, see ``digest.py``), which a format-3 reader would take
for corruption. ``manifest_sha256``, the classes in ``contents`` and ``run`` are
optional on read, so checkpoints written before them still load.

Why a crash at any instant leaves the previous checkpoint loadable. A save writes into
``root/.tmp-step_<N>-<uuid>/``, a name no reader ever picks (readers only look at
``step_*``). Every file is fsynced, the manifest last, then the directory is fsynced and
renamed to ``step_<N>`` in one ``rename(2)``, which POSIX makes atomic within a file
system, and the parent directory is fsynced so the rename itself survives a power loss.
So at every instant ``step_<N>`` either does not exist or is complete:

* killed while writing files: only the ``.tmp-*`` directory is partial; the next save
  removes it; the previous ``step_*`` directories were never touched;
* killed between the rename and the parent fsync: after a process kill the rename is
  already visible; after a power loss either name may survive, both complete;
* killed during retention: old checkpoints are first renamed to ``.trash-*`` (atomic),
  then deleted, so a half-deleted one never carries a ``step_*`` name; the newest valid
  checkpoint is never deleted;
* killed during a re-save of a step that exists (a resumed run saving the step it
  resumed): the old ``step_<N>`` is renamed to ``.aside-step_<N>``, the new one renamed
  in, then the aside deleted. Between the two renames the aside is that step's
  checkpoint: :func:`list_checkpoints` lists it while ``step_<N>`` is missing, and the
  next save renames it back. Without the aside, a kill there would lose both copies
  (both under names no reader picks), and with ``keep_last=1`` restart the run at step 0.

Runs kept apart: a guard's checkpoints carry its run's id (``run.id`` in the manifest:
new for a fresh start, carried over by a resume). Retention counts only this run's
checkpoints, and a resume tries the run that saved last first
(:func:`~guardrails.checkpoint.manifest.resume_order`, by each manifest's save sequence
number ``seq``, not by its clock time): a fresh run started beside another run's
checkpoints does not have its low steps deleted for the other run's high ones, nor does
a later ``resume="auto"`` pick the other run's.

Storage errors: a save that cannot write (a full disk, a read-only remount, missing
permissions) raises :class:`~guardrails.CheckpointError` naming the cause and the fix
(free space, the permissions, another ``run_dir``) and the latest checkpoint that
remains; the partial temp directory is removed and nothing that resume would pick is
left behind.

Readers trust nothing: a checkpoint counts as valid only when ``manifest.json`` parses,
matches its own ``manifest_sha256`` (a flipped bit in the manifest could otherwise
change the step or a file's recorded hash), names no file outside its directory, and
every file it lists has the recorded size and sha256. Resuming from a run directory
takes the newest valid one and logs why each newer one was skipped (a disk that filled
up, a bit flip in transit, a truncated copy). Everything is checked (checksums, the
saved classes, then key names and shapes against the model and optimizer) before
anything is loaded, so a ``CheckpointError`` or ``ResumeError`` leaves the model,
optimizer, scheduler and scaler exactly as they were.

Distributed runs: :func:`save_checkpoint` called directly writes rank 0's copy, which
is complete for replicated state (DDP, where every rank holds the same weights and
optimizer state); other ranks return without writing. The guard's saves write every
rank's own files into one temp directory, and rank 0 writes the manifest and renames:
one atomic commit for the whole job (``guards/checkpointer/``).

Only one process may save into a ``root`` at a time.
"""
