"""What the real-script harnesses (``benchmarks/nanochat/run.py``,
``benchmarks/nanogpt/run.py``) share: which guardrails ran, each rank's exit code from
torchrun's summary, the lines of a run's stderr that say how it ended, its events, and
the bitwise comparison of final weights."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def guardrails_version() -> dict[str, Any]:
    """Which guardrails ran: HEAD, whether guardrails/ had uncommitted changes, and a
    hash of its sources (the engine changes under these harnesses)."""
    git = ["git", "-C", str(REPO)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "guardrails"], capture_output=True, text=True
    )
    digest = hashlib.sha256()
    for path in sorted((REPO / "guardrails").glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return {
        "head": head.stdout.strip(),
        "uncommitted_files": len(dirty.stdout.splitlines()),
        "sources_sha256": digest.hexdigest()[:16],
    }


def patched_trees(
    source: Path, work: Path, patch_dir: Path, variants: dict[str, list[str]]
) -> dict[str, Path]:
    """A fresh copy of ``source`` under ``work`` for each variant (its name), with its
    patches (files of ``patch_dir``) applied in order by ``git apply``."""
    trees = {}
    for name, patches in variants.items():
        tree = work / name
        shutil.rmtree(tree, ignore_errors=True)
        shutil.copytree(source, tree)
        for patch in patches:
            subprocess.run(["git", "apply", str(patch_dir / patch)], cwd=tree, check=True)
        trees[name] = tree
    return trees


def rank_exit_codes(stderr: str, rc: int | None, world: int) -> dict[int, int | None]:
    """Each rank's exit code: the process's own for one process; from torchrun's failure
    summary (``rank : 1 (local_rank: 1)`` then ``exitcode : 143``) for several. A rank it
    does not list ended 0 before the others failed, or never ran: ``None``. All 0 when
    torchrun itself returned 0."""
    if world == 1 or rc == 0:
        return dict.fromkeys(range(world), rc)
    found = {
        int(m[1]): int(m[2])
        for m in re.finditer(
            r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", stderr
        )
    }
    return {r: found.get(r) for r in range(world)}


def key_lines(stderr: str, limit: int = 14) -> list[str]:
    """The lines that say how the run ended: guardrails' summaries, warnings and fixes,
    and the last line of each Python traceback (deduplicated, ranks' prefixes kept)."""
    keep = re.compile(
        r"guardrails: rank \d+ failed with|\b\w+(Error|Exception|Warning): |\] (stopped|nonfinite"
        r"|spike|data_fast_forward)\b|^\s*\[(rank \d+, )?step \d+\]|guardrails: resumed from"
        r"|^\s*fix: "
    )
    seen: dict[str, None] = {}
    for line in stderr.splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
        if keep.search(line) and "Traceback" not in line:
            seen.setdefault(line[:500], None)
    return list(seen)[:limit]


def read_events(run_dir: Path) -> list[dict]:
    """Every rank's events of a guardrails run dir, in time order."""
    events = []
    for path in sorted(run_dir.glob("events*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                events.append(json.loads(line))
    return sorted(events, key=lambda e: e.get("time", 0))


def compare(a: dict | None, b: dict | None) -> tuple[bool, str]:
    """Bitwise equality of two state dicts (torch.equal on every tensor); ``None``: that
    run left no final weights."""
    import torch

    if a is None or b is None:
        return False, "no final weights (" + ("first" if a is None else "second") + " run)"
    if a.keys() != b.keys():
        return False, "different tensor names"
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    if not diff:
        return True, f"all {len(a)} tensors bitwise equal"
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in diff)
    return False, f"{len(diff)}/{len(a)} tensors differ (max abs diff {worst:.3g}), e.g. {diff[0]}"


def exits(
    codes: dict[int, int | None], code: int, ranks_done: set[int], what: str, world: int
) -> tuple[bool, str]:
    """Did every rank end with ``code``? torchrun SIGTERMs the ranks still running as soon
    as one exits non-zero, so a rank that had already done ``what`` (``ranks_done``: seen
    in its events or its summary) but was still exiting may show -15 instead: that is
    torchrun's teardown, told apart and said so, not counted as a failure."""
    killed = sorted(r for r, c in codes.items() if c == -signal.SIGTERM and r in ranks_done)
    own = {c for r, c in codes.items() if r not in killed}
    ok = own == {code} and ranks_done == set(range(world))
    text = f"rank exit codes {codes}"
    for r in killed:
        text += f" (rank {r} had {what}, then torchrun's teardown SIGTERMed it before it exited)"
    missing = sorted(set(range(world)) - ranks_done)
    if missing:
        text += f"; ranks {missing} never {what}"
    return ok, text
