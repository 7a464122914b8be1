"""Where a thread is: the main thread's stack, its innermost frame in the user's code, the
position it advertises. Read by the watchdog (a hang's stacks) and the checkpointer (a
signal stuck behind a collective is reported the way a hang is). Also how guardrails
reads a frame's variables without keeping them alive (``frame_locals``) and whether
its caller is ``torch.compile``'d code (``under_compiled_code``).
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard


# A stack is capped (innermost frames kept): 30 frames cover a training step's depth
# with room for the framework around it, and keep one rank's record under ~6 KB.
STACK_FRAMES = 30


TORCH_DIR = str(Path(__import__("torch").__file__).parent) + os.sep


# guardrails/ itself (this file is guardrails/engine/where.py): its frames are not the user's.
PACKAGE_DIR = str(Path(__file__).parents[1]) + os.sep


STDLIB_DIRS = tuple(
    {sysconfig.get_paths()["stdlib"] + os.sep, sysconfig.get_paths()["platstdlib"] + os.sep}
)


def progress_key(guard: Guard) -> tuple[Any, ...]:
    """What the main thread advertises, as one comparable value: it changes whenever the
    rank makes progress (a step, a batch, a phase, a collective)."""
    coll = guard.shared.collective
    return (
        guard.step,
        data_position(guard),
        guard.phase,
        None if coll is None else (coll.get("seq"), coll.get("op")),
    )


def main_thread_site() -> str:
    """Where the main thread is, in the user's code: ``file:line (function)`` of its
    innermost frame outside torch, guardrails and the standard library."""
    frames = parse_stack(thread_stack(threading.main_thread().ident or 0))
    for path, line, func in reversed(frames):
        if is_user_file(path):
            return f"{os.path.basename(path)}:{line} ({func})"
    if frames:
        path, line, func = frames[-1]
        return f"{os.path.basename(path)}:{line} ({func})"
    return "an unknown place"


def thread_site(ident: int) -> str:
    """Where thread ``ident`` is: ``file:line (function)`` of its innermost frame (a
    C call blocks under it)."""
    frames = parse_stack(thread_stack(ident))
    if not frames:
        return "an unknown place"
    path, line, func = frames[-1]
    return f"{os.path.basename(path)}:{line} ({func})"


def data_position(guard: Guard) -> tuple[int, int]:
    """This rank's data position: where its loader ran out, else the current pass and
    batch. ``exhausted_at`` is read first: the engine sets it before it moves the epoch
    counters on, so a non-``None`` value is always consistent."""
    done = guard.exhausted_at
    return done if done is not None else (guard.epoch, guard.batch_in_epoch)


def thread_stack(ident: int) -> str:
    """The Python stack of thread ``ident``, innermost frame last, capped."""
    frame = sys._current_frames().get(ident)
    if frame is None:
        return "  (the thread has ended)"
    frames = traceback.extract_stack(frame)[-STACK_FRAMES:]
    return "".join(traceback.format_list(frames)).rstrip()


def parse_stack(stack: str) -> list[tuple[str, str, str]]:
    """(file, line, function) of each ``File "...", line N, in f`` line of a stack."""
    out = []
    for line in stack.splitlines():
        line = line.strip()
        if line.startswith('File "'):
            try:
                path, rest = line[6:].split('", line ', 1)
                num, func = rest.split(", in ", 1)
                out.append((path, num, func))
            except ValueError:
                continue
    return out


def is_user_file(path: str) -> bool:
    return not (
        path.startswith(TORCH_DIR) or path.startswith(PACKAGE_DIR) or path.startswith(STDLIB_DIRS)
    )


# CPython 3.11/3.12: reading a function frame's ``f_locals`` stores a snapshot dict on the
# frame that holds every local as it was, until the frame's next read or its end. A
# tensor the loop deletes afterwards stays allocated: an OOM's activations (71 GB on an
# H200, through a caught error the snapshot held) or a dataset freed after the guard
# started. 3.13 made ``f_locals`` a live view with no snapshot (PEP 667).
_SNAPSHOTS = sys.version_info < (3, 13)
_CO_OPTIMIZED = 0x1  # a function's frame: its locals are not a namespace dict of its own
# What holds a snapshot right after the read: the frame, our name, getrefcount's argument.
_UNSHARED = 3


def frame_locals(frame: Any) -> dict[str, Any]:
    """A copy of a live frame's local variables, leaving nothing alive on the frame.

    The snapshot is emptied after the copy unless someone else holds it (a loop that
    kept ``locals()``: emptying would empty its dict) or it is a real namespace (a
    module's or a class body's frame, whose ``f_locals`` is its ``__dict__``)."""
    snap = frame.f_locals
    copy = dict(snap)
    if _SNAPSHOTS and frame.f_code.co_flags & _CO_OPTIMIZED and sys.getrefcount(snap) == _UNSHARED:
        snap.clear()
    return copy


# Dynamo's entry into compiled code: the frame of a compiled module's or function's
# wrapper (``_fn``, ``compile_wrapper``), and of ``torch._dynamo.disable``'s.
_EVAL_FRAME = os.path.join("torch", "_dynamo", "eval_frame.py")


def under_compiled_code() -> bool:
    """Whether the calling guardrails code was reached from inside ``torch.compile``'d
    code: above the innermost frames of guardrails and of its own ``disable`` wrappers,
    a frame of dynamo's entry is on the stack (``opt = torch.compile(model)`` calling the
    guarded ``model``, or a compiled training step calling it)."""
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename.startswith(PACKAGE_DIR)
        or frame.f_code.co_filename.endswith(_EVAL_FRAME)
    ):
        frame = frame.f_back
    while frame is not None:
        if frame.f_code.co_filename.endswith(_EVAL_FRAME):
            return True
        frame = frame.f_back
    return False
