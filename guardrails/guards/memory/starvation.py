"""Data starvation: the accelerator idles while the training loop waits for the loader.

"Training is too slow" often means the GPU waits for data: loading, decoding and
collating in the training process (``num_workers=0``), too few workers, no prefetch,
unpinned host memory. :class:`StarvationMeter` keeps two sums, the time each step spent
blocked in the loader's ``next()`` and the step time (two float adds per step, done
by the caller on the meter's fields: no call per step); at the end of each window of
``data_starvation_window_steps`` (step 1 excluded: worker start-up, lazy init, the GC
freeze) the share decides. One ``data_starvation`` event per run, with the numbers and
the remedies that fit this loader (its ``num_workers``, ``pin_memory``...).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch

from guardrails.util.probes import usable_cpus

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

logger = logging.getLogger("guardrails.memory")


class StarvationMeter:
    """The data-wait share of one guarded run, judged per window. The caller adds each
    step's times to ``wait_s`` and ``step_s`` and calls :meth:`end_window` once
    ``step >= next_window``."""

    def __init__(self, window_steps: int | None, fraction: float, min_wait_s: float = 0.0) -> None:
        self.window_steps = window_steps
        self.fraction = fraction
        self.min_wait_s = min_wait_s
        self.wait_s = self.step_s = 0.0
        self._window_start = 1
        self.next_window: float = 1 if window_steps else math.inf

    def end_window(self, guard: Guard, step: int) -> dict[str, Any] | None:
        """Judge the window that ends at ``step``. Returns the ``data_starvation``
        event's fields when it is reported (the event is written here; once per run),
        else None (also after a ``loader_shared_cores`` info event, once per run)."""
        window = self.window_steps
        assert window is not None
        first, n = self._window_start + 1, step - self._window_start
        wait, total = self.wait_s, self.step_s
        self.wait_s = self.step_s = 0.0
        self._window_start = step
        self.next_window = step + window
        if n == 0 or not total > 0:  # step 1: the warm-up, excluded
            return None
        share = wait / total
        # Both: a share worth acting on, of a wait worth acting on. A tiny CPU step
        # (0.5 ms) spends 0.1-0.2 ms in a list's or a generator's next(): a third of the
        # step, and nothing a loader setting would change.
        if share < self.fraction or wait / n < self.min_wait_s:
            return None
        self.next_window = math.inf  # reported once per run
        settings = loader_settings(guard.loader)
        fields = {
            "share": share,
            "mean_wait_s": wait / n,
            "mean_step_s": total / n,
            "window_steps": [first, step],
            "loader": settings,
        }
        device = guard.device.type
        cores, threads = usable_cpus(), torch.get_num_threads()
        # A CPU run whose workers and compute threads already cover every core: the
        # workers' time is the training's own CPU, so more of them cannot help, and a
        # light batch's transfer between processes (each tensor handed over by its
        # worker, which must be scheduled) is most of the wait. Measured, a 2-core
        # machine, 2 workers, a 4.6 ms CPU step: 1.9 ms in next() where loading in the
        # training process took 0.4 ms. Advice, not a fault: an info event of its own.
        shared = shares_cores(settings, device, cores, threads)
        remedies = starvation_remedies(settings, device, cores, threads)
        fields["remedies"] = remedies
        waited = (
            f"over steps {first}-{step} this rank waited for the loader {share:.0%} of the "
            f"step time ({fields['mean_wait_s'] * 1e3:.1f} ms of "
            f"{fields['mean_step_s'] * 1e3:.1f} ms per step)"
        )
        if shared:
            assert settings is not None
            guard.event(
                "loader_shared_cores",
                message=f"{waited}: its {settings['num_workers']} worker process(es) and "
                f"the training's {threads} thread(s) share this machine's {cores} cores, so "
                "more workers would not make the step faster. To try: " + "; ".join(remedies),
                cores=cores,
                threads=threads,
                **fields,
            )
            return None
        guard.event(
            "data_starvation",
            level="warning",
            message=f"data starvation: {waited}, so the "
            + ("GPU idles" if device == "cuda" else "training waits")
            + " that long each step. Remedies: "
            + "; ".join(remedies)
            + ". A wait that passes (a cache warming up) needs nothing; the bar is "
            f"guard(..., memory={{'data_starvation_fraction': {self.fraction:g}}}).",
            **fields,
        )
        return fields


def shares_cores(
    settings: dict[str, Any] | None, device_type: str, cores: int, threads: int
) -> bool:
    """Whether a CPU run's loader workers and compute threads already take every core."""
    return (
        device_type == "cpu"
        and settings is not None
        and settings["num_workers"] > 0
        and settings["num_workers"] + threads >= cores
    )


def loader_settings(loader: Any) -> dict[str, Any] | None:
    if not isinstance(loader, torch.utils.data.DataLoader):
        return None
    return {
        "num_workers": loader.num_workers,
        "prefetch_factor": loader.prefetch_factor,
        "pin_memory": loader.pin_memory,
        "persistent_workers": loader.persistent_workers,
    }


def starvation_remedies(
    settings: dict[str, Any] | None, device_type: str, cores: int, threads: int = 1
) -> list[str]:
    """The remedies that fit this loader on this device: pinned memory only where a
    batch is copied to an accelerator; more workers only where a core is left for them."""
    accelerator = device_type != "cpu"
    pin = "pin_memory=True and .to(device, non_blocking=True)"
    if settings is None:
        out = [
            "load in worker processes: torch.utils.data.DataLoader(dataset, "
            f"num_workers=4..8, this machine has {cores} cores) instead of in the loop",
            "prefetch: prefetch_factor=4 with workers",
        ]
        return [
            *out,
            *([pin] if accelerator else []),
            "persistent_workers=True so workers survive between epochs",
            "pack sequences to cut padding; pre-tokenize and store shards",
        ]
    out = []
    workers = settings["num_workers"]
    if workers == 0:
        out.append(
            f"num_workers=0 loads every batch in the training process: set num_workers to "
            f"4-8 (this machine has {cores} cores)"
        )
    elif shares_cores(settings, device_type, cores, threads):
        out.append(
            "num_workers=0 when the per-sample work is light (a dataset in memory): "
            "each batch is then made in the training process, with no transfer between "
            "processes"
        )
        out.append("cheaper per-sample work (pre-decode, pre-augment, store shards)")
        return out
    else:
        out.append(f"more workers than num_workers={workers} (this machine has {cores} cores)")
        if not settings["persistent_workers"]:
            out.append("persistent_workers=True so workers are not restarted every epoch")
        out.append(f"a deeper prefetch than prefetch_factor={settings['prefetch_factor']}")
    if accelerator and not settings["pin_memory"]:
        out.append("pin_memory=True with .to(device, non_blocking=True)")
    out.append("pack sequences to cut padding; pre-tokenize and store shards")
    return out
