"""``python -m guardrails stacks RUN_DIR``: every rank's Python stacks, now, without
stopping the job, grouped by identical stacks.

The command writes a request into ``RUN_DIR/live/``; each node's lowest rank sees it
within a second (one ``stat`` of that file a period), tells its node's ranks through
shared memory, and each rank's watchdog thread answers with every thread's stack. The
answering thread is not the main one, so a rank stuck in a C call (a collective, a
read, a ``ctypes`` call) answers too: its stack ends at the Python line that called
into C, and its main thread's CPU share tells computing from blocked. Nothing is
asked of the job while nobody runs this. No torch.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from guardrails.metrics import live

#: How long the command waits for every rank's answer by default.
WAIT_S = 15.0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "stacks",
        help="every rank's Python stacks now, grouped by identical stacks",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="See docs/cli.md, 'top and stacks'.",
    )
    p.add_argument("run_dir", type=Path, help="the guard's run_dir")
    p.add_argument(
        "--wait-s",
        type=float,
        default=WAIT_S,
        help=f"wait for the answers (default {WAIT_S:.0f} s)",
    )
    p.add_argument("--json", action="store_true", help="print every rank's answer as JSON")
    p.add_argument(
        "--all-threads", action="store_true", help="also guardrails' own threads' stacks"
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    records = live.read_snapshot(args.run_dir)
    running = sorted(r for r, rec in records.items() if rec.get("state") == "running")
    if not running:
        print(
            f"guardrails stacks: no running job publishes in {args.run_dir}: "
            + (
                "every rank's last record says it ended."
                if records
                else f"no {live.LIVE_DIR}/node*.json (not started yet, run with "
                "guard(watchdog=False), or not its run_dir)."
            )
        )
        return 2
    world = max(int(rec.get("world", 0)) for rec in records.values())
    asked = live.request_stacks(args.run_dir)
    deadline = time.monotonic() + args.wait_s
    answers: dict[int, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        answers = live.read_answers(args.run_dir, asked["id"])
        if len(answers) >= world:
            break
        time.sleep(0.2)
    took = time.time() - asked["time"]
    live.remove_answers(args.run_dir, asked["id"])
    missing = [r for r in range(world) if r not in answers]
    if args.json:
        print(json.dumps({"took_s": round(took, 2), "missing": missing, "ranks": answers}))
    else:
        print(render(answers, world=world, took_s=took, all_threads=args.all_threads))
        if missing:
            print(
                f"\nno answer from rank {ranges(missing)} within {args.wait_s:.0f} s: its "
                "process is gone, or its watchdog thread cannot run (a C call that holds "
                "the GIL); `py-spy dump --pid PID` on its host shows the C stack."
            )
    return 1 if missing else 0


# ---------------------------------------------------------------------- grouping


def ranges(ranks: list[int]) -> str:
    """``[0, 2, 3, 4, 7]`` -> ``"0,2-4,7"``."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def summary(stack: list[list[Any]]) -> str:
    """Where a thread is, in one line: the function it is inside (when that is not the
    user's own frame), at the user's innermost line, and that line's code."""
    if not stack:
        return "no Python frame"
    user = [f for f in stack if is_user_frame(f[0])]
    inner = stack[-1]
    text = ""
    if not user or user[-1] is not inner:
        text = f"in {inner[2]} "
    at = user[-1] if user else inner
    text += f"at {os.path.basename(at[0])}:{at[1]} ({at[2]})"
    return text + (f": {at[3]}" if at[3] else "")


#: guardrails' own folder (this file is guardrails/cli/stacks.py).
PACKAGE_DIR = str(Path(__file__).resolve().parents[1]) + os.sep


def is_user_frame(path: str) -> bool:
    """Not torch, guardrails or the standard library: the path alone says (the stack
    may come from another machine; no torch import here)."""
    parts = Path(path).parts
    if path.startswith(PACKAGE_DIR) or "torch" in parts:
        return False
    in_lib = any(p.startswith("python3") for p in parts) and "lib" in parts
    return not in_lib or "site-packages" in parts or "dist-packages" in parts


def group(answers: dict[int, dict[str, Any]], *, all_threads: bool) -> list[dict[str, Any]]:
    """Threads with identical stacks across ranks: the main threads first, each group's
    ranks, its stack and the ranks' main-thread CPU shares."""
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for rank, answer in sorted(answers.items()):
        for thread in answer.get("threads", []):
            if not all_threads and thread["name"].startswith("guardrails-") and not thread["main"]:
                continue
            key = (thread["main"], tuple(tuple(f[:3]) for f in thread["stack"]))
            g = groups.setdefault(
                key, {"main": thread["main"], "stack": thread["stack"], "ranks": [], "names": set()}
            )
            g["ranks"].append(rank)
            g["names"].add(thread["name"])
            if thread["main"]:
                g.setdefault("cpu", []).append(answer.get("cpu"))
    return sorted(groups.values(), key=lambda g: (not g["main"], g["ranks"]))


def render(
    answers: dict[int, dict[str, Any]], *, world: int, took_s: float, all_threads: bool
) -> str:
    groups = group(answers, all_threads=all_threads)
    lines = [f"stacks of {len(answers)} of {world} ranks, answered in {took_s:.1f} s", ""]
    lines.append("main threads:")
    for g in groups:
        if g["main"]:
            lines.append(f"  rank {ranges(g['ranks'])}: {summary(g['stack'])}{_cpu(g)}")
    for g in groups:
        who = "main thread" if g["main"] else "thread " + ", ".join(sorted(g["names"]))
        lines += ["", f"rank {ranges(g['ranks'])}, {who}:"]
        for path, line, func, code in g["stack"]:
            lines.append(f'  File "{path}", line {line}, in {func}')
            if code:
                lines.append(f"    {code}")
    return "\n".join(lines)


def _cpu(g: dict[str, Any]) -> str:
    cpus = [c for c in g.get("cpu", []) if c is not None]
    if not cpus:
        return ""
    lo, hi = min(cpus), max(cpus)
    share = f"{lo:.0%}" if round(lo, 2) == round(hi, 2) else f"{lo:.0%}-{hi:.0%}"
    return f" ({share} CPU)"
