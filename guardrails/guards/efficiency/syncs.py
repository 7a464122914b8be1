"""Host syncs in the user's loop, found by sampling a few steps under torch's sync debug
mode.

A host-device sync (``loss.item()``, ``print(loss)``, ``if (x > 0).any():``, a copy to
non-pinned host memory) stops the Python thread until the GPU has finished everything
queued before it; the GPU then idles while Python prepares the next kernels, every
step. ``torch.cuda.set_sync_debug_mode("warn")`` makes torch raise a warning at each
such call; while a few steps are sampled this module catches those warnings (they are
not shown), walks the Python stack of each to its innermost frame outside torch,
guardrails and the standard library (the user's line), and counts them per site and
step. A sync whose innermost such frame is guardrails' own is not the user's: kept
apart (:attr:`SyncSampler.own`), never reported as theirs.

The mode is a process-wide setting, and the warnings machinery is shared: the previous
mode comes back exactly, and the filter and ``warnings.showwarning`` put in for the
sample are taken out (only those: a filter the loop added meanwhile stays). Warnings
that are not sync warnings go on to the previous ``showwarning``, as they would have.
"""

from __future__ import annotations

import linecache
import os
import sys
import threading
import warnings
from typing import Any

import torch

from guardrails.engine.where import PACKAGE_DIR, STDLIB_DIRS, TORCH_DIR

#: The text of torch's warning (c10/cuda's ``warn_or_error_on_sync``).
SYNC_MESSAGE = "called a synchronizing CUDA operation"

#: What to do about a sync, by what its source line does (the first pattern found).
ADVICE = (
    (
        ".item()",
        ".item() copies the value to the host: keep it on the device (sum losses into a "
        "tensor: total += loss.detach()) and read it every N steps",
    ),
    (
        ".tolist()",
        ".tolist() copies to the host: keep the values on the device, read them every N steps",
    ),
    (
        "print(",
        "printing a CUDA tensor copies it to the host: print every N steps, or print a "
        "value read every N steps",
    ),
    (
        ".cpu()",
        ".cpu() waits for the GPU: copy with .to('cpu', non_blocking=True) into pinned "
        "memory and read it a step later, or only every N steps",
    ),
    (
        "if ",
        "a CUDA tensor used as a condition (bool(tensor), if (x > 0).any():) is read on "
        "the host: compute the branch on the device (torch.where) or check every N steps",
    ),
    (
        "scaler.step(",
        "a GradScaler reads on the host whether the gradients overflowed, every step: "
        "inherent to fp16 loss scaling; bf16 autocast needs no scaler (and no sync)",
    ),
    (
        ".step(",
        "the optimizer's step reads a value on the host: build it with fused=True, or "
        "capturable=True where it offers that",
    ),
    (
        ".backward(",
        "a sync during the backward pass: a backward hook, a custom autograd Function "
        "or a gradient clip with error_if_nonfinite=True reads a value on the host",
    ),
    (
        "float(",
        "float(tensor) copies the value to the host: keep it on the device, read it every N steps",
    ),
)
GENERIC_ADVICE = (
    "this call waits for the GPU to finish its queue: move it out of the per-step path or "
    "do it every N steps"
)


class SyncSampler:
    """Sync debug mode ``"warn"`` between :meth:`start` and :meth:`stop`, its warnings
    counted per call site and sampled step (:meth:`next_step` starts the next one)."""

    def __init__(self) -> None:
        #: ``file:line (function)`` of each sync in the user's code -> its count in
        #: each sampled step so far.
        self.sites: dict[str, list[int]] = {}
        #: The source line of each site, stripped.
        self.lines: dict[str, str] = {}
        #: Syncs guardrails' own code made while sampling, by site (a sync on the fast
        #: path would be a bug of guardrails', never the user's to fix).
        self.own: dict[str, int] = {}
        #: Steps sampled (started) so far.
        self.steps = 0
        #: Between start() and stop().
        self.active = False
        self._prev_mode = 0
        self._mode_set = False  # start() set the mode: stop() puts the previous one back
        self._prev_show: Any = None
        self._filter: Any = None
        self._main = threading.main_thread().ident
        self._hook = self._show  # one bound method: compared by identity at release

    def start(self) -> bool:
        """Enter the mode; ``False`` (nothing changed) when the loop already set one
        itself: it is debugging its syncs, and ``"error"`` must stay an error."""
        prev = torch.cuda.get_sync_debug_mode()
        if prev != 0:
            return False
        self._prev_mode = prev
        self.catch_warnings()
        torch.cuda.set_sync_debug_mode("warn")
        self._mode_set = True
        return True

    def catch_warnings(self) -> None:
        """Catch torch's sync warnings (every one: an ``"always"`` filter for their
        text ahead of the loop's own filters); pass the others on."""
        self._prev_show = warnings.showwarning
        warnings.showwarning = self._hook
        warnings.filterwarnings("always", message=SYNC_MESSAGE, category=UserWarning)
        self._filter = warnings.filters[0]
        self.active = True
        self.next_step()

    def next_step(self) -> None:
        """The next sampled step begins."""
        self.steps += 1
        for counts in self.sites.values():
            counts.append(0)

    def stop(self) -> None:
        """Leave the mode: the previous mode, ``showwarning`` and filters come back."""
        if not self.active:
            return
        if self._mode_set:
            self._mode_set = False
            torch.cuda.set_sync_debug_mode(self._prev_mode)
        self.release_warnings()

    def release_warnings(self) -> None:
        """Take out the filter and ``showwarning`` :meth:`catch_warnings` put in (a
        filter or ``showwarning`` the loop set meanwhile stays)."""
        self.active = False
        if warnings.showwarning is self._hook:
            warnings.showwarning = self._prev_show
        for i, f in enumerate(warnings.filters):
            if f is self._filter:
                del warnings.filters[i]
                _filters_mutated()
                break
        self._filter = self._prev_show = None

    def _show(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        if not (issubclass(category, UserWarning) and SYNC_MESSAGE in str(message)):
            prev = self._prev_show
            if prev is None:  # released meanwhile: Python's own
                prev = warnings._showwarning_orig  # type: ignore[attr-defined]
            prev(message, category, filename, lineno, file, line)
            return
        if threading.get_ident() != self._main or not self.active:
            return  # a loader's pin-memory thread: not the loop's
        site, path, line_no, own = _site(sys._getframe(1))
        if own:
            self.own[site] = self.own.get(site, 0) + 1
            return
        counts = self.sites.get(site)
        if counts is None:
            counts = self.sites[site] = [0] * self.steps
            self.lines[site] = linecache.getline(path, line_no).strip() if path else ""
        counts[-1] += 1

    # ------------------------------------------------------------------ the report

    def every_step(self) -> dict[str, list[int]]:
        """The sites that synced in every sampled step."""
        return {s: c for s, c in self.sites.items() if all(c)}

    def message(self, first_step: int) -> str:
        """What the user reads: the sites, per step, with what to do about each."""
        steps = self.steps
        last = first_step + steps - 1
        per_step = sum(sum(c) for c in self.every_step().values()) / steps
        head = (
            f"{per_step:.3g} host-device sync(s) per step in your loop (steps {first_step}-"
            f"{last} sampled under torch.cuda.set_sync_debug_mode('warn')): each one stops "
            "Python until the GPU has finished everything queued, so the GPU then idles "
            "while the next kernels are prepared."
            if per_step
            else f"host-device syncs in some of the sampled steps ({first_step}-{last}) of "
            "your loop, not in every one (e.g. logging every N steps)."
        )
        lines = [head]
        for site, counts in sorted(self.sites.items(), key=lambda kv: -sum(kv[1])):
            src = self.lines.get(site) or ""
            every = all(counts)
            n = sum(counts) / steps
            how_often = (
                f"{n:.3g} per step"
                if every
                else f"in {sum(1 for c in counts if c)} of {steps} steps"
            )
            lines.append(
                f"  {site}" + (f" `{src}`" if src else "") + f": {how_often}; {advice(src)}"
            )
        return "\n".join(lines)


def _filters_mutated() -> None:
    """Tell the warnings machinery its filter list changed (its cache of "already
    shown" is keyed on the list's version); Python 3.14 renamed the hook."""
    hook = getattr(warnings, "_filters_mutated", None) or getattr(
        warnings, "_filters_mutated_lock_held", None
    )
    if hook is not None:
        hook()


def advice(source: str) -> str:
    """What to do about a sync made by this source line."""
    for pattern, text in ADVICE:
        if pattern in source:
            return text
    return GENERIC_ADVICE


#: The engine's wrappers that only hand control to the loop's own objects (the model's
#: forward, the optimizer's step, the loader's next batch, a loss's backward, a
#: GradScaler's scale and step, a closure): a sync under one of them, with no other
#: guardrails frame in between, is the loop's (its loader's, its optimizer's), told at
#: the loop's line that called it.
_GUARD_PY = os.path.join(PACKAGE_DIR, "engine", "guard.py")
PASS_THROUGH = frozenset({"forward", "step", "_batches", "backward", "scale", "__call__"})


def _site(frame: Any) -> tuple[str, str, int, bool]:
    """``(file:line (function), its file's path, the line, guardrails' own)`` of the
    innermost frame outside torch and the standard library, from ``frame`` outwards
    (through the engine's pass-through wrappers)."""
    while frame is not None:
        code = frame.f_code
        path = code.co_filename
        ours = path.startswith(PACKAGE_DIR)
        if ours and path == _GUARD_PY and code.co_name in PASS_THROUGH:
            frame = frame.f_back
            continue
        if ours or not (
            path.startswith(TORCH_DIR) or path.startswith(STDLIB_DIRS) or path.startswith("<frozen")
        ):
            line = frame.f_lineno
            return f"{os.path.basename(path)}:{line} ({code.co_name})", path, line, ours
        frame = frame.f_back
    return "an unknown place", "", 0, False
