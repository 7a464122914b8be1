"""``python -m guardrails inspect CKPT_DIR``: what checkpoints a directory holds, which
ones a resume would accept, and what state each carries.

Accepts a run directory (its ``checkpoints/`` is used), a checkpoint root or one
``step_*`` directory. Every file is verified against the manifest (sizes and sha256,
reading each byte once), so the answer to "which one would ``resume`` pick?" is the
same one :func:`guardrails.resume` would give: the checks are the ones resume runs
(:mod:`guardrails._manifest`), which need no torch, so the command starts without it.
Exit code 0 when at least one checkpoint is valid, 1 when none is, 2 when there is
nothing there.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any

from guardrails import _manifest


def inspect_dir(path: Path) -> dict[str, Any]:
    """Facts about every checkpoint under ``path`` (JSON-able)."""
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if _manifest.STEP_RE.match(path.name) and path.is_dir():
        found = [(int(_manifest.STEP_RE.match(path.name).group(1)), path)]  # type: ignore[union-attr]
    else:
        found = _manifest.list_checkpoints(path)
    rows = [_one(step, ckpt) for step, ckpt in found]
    # As resume picks: the newest valid one, in resume's order (the run that saved last
    # first, newest step first); a newer format on the way stops it (an error, not a
    # fall back to an older checkpoint).
    order = {str(ckpt): i for i, (_, ckpt) in enumerate(_manifest.resume_order(found))}
    use = None
    for r in sorted(rows, key=lambda r: order[r["path"]]):
        if r["valid"] or r.get("too_new"):
            use = None if r.get("too_new") else r["path"]
            break
    return {
        "root": str(path),
        "checkpoints": rows,
        "resume_would_use": use,
        "leftovers": sorted(
            p.name
            for p in (path.iterdir() if path.is_dir() else [])
            if p.name.startswith((".tmp-", ".trash-"))
        ),
    }


def _one(step: int, ckpt: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"step": step, "path": str(ckpt)}
    try:
        problem = _manifest.problem(ckpt)
        why = None if problem is None else problem[1]
    except _manifest.ManifestError as e:  # a newer format: resume stops there too
        why = f"{e.message}: {e.hint}"
        row["too_new"] = True
    row["valid"] = why is None
    row["problem"] = why
    try:
        manifest = json.loads((ckpt / _manifest.MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError):
        return row
    row["bytes"] = sum(int(f.get("bytes", 0)) for f in files.values())
    row["time"] = manifest.get("time")
    row["world_size"] = manifest.get("world_size")
    row["guardrails"] = manifest.get("guardrails")
    row["torch"] = manifest.get("torch")
    held = []
    if "model.safetensors" in files:
        held.append("model")
    if "optimizer.json" in files:
        held.append("optimizer")
    if "scheduler.json" in files or "scheduler.pt" in files:
        held.append("scheduler")
    if "scaler.json" in files:
        held.append("scaler")
    ranks = sorted(n for n in files if n.startswith("rank") and n.endswith(".json"))
    if ranks or "rng.json" in files:
        held.append(f"rng ({len(ranks) or 1} rank{'s' if len(ranks) > 1 else ''})")
    if ranks and row["valid"]:
        try:
            first = json.loads((ckpt / ranks[0]).read_text())
            data = first.get("data")
            if data:
                held.append(
                    f"data position (epoch {data['epoch']}, batch {data['batch_in_epoch']}, "
                    f"{data['kind']})"
                )
            if first.get("components"):
                held.append("guard state (" + ", ".join(sorted(first["components"])) + ")")
        except (OSError, ValueError, KeyError):
            pass
    if row["valid"] and "extras.json" in files:
        try:
            extras = json.loads((ckpt / "extras.json").read_text())
            if extras:
                held.append("extras (" + ", ".join(sorted(extras)) + ")")
        except (OSError, ValueError):
            pass
    row["holds"] = held
    return row


def render(facts: dict[str, Any]) -> str:
    rows = facts["checkpoints"]
    if not rows:
        return f"no checkpoint under {facts['root']}"
    lines = [f"{len(rows)} checkpoint(s) under {facts['root']}:"]
    for r in rows:
        when = (
            datetime.datetime.fromtimestamp(r["time"]).strftime("%Y-%m-%d %H:%M:%S")
            if r.get("time")
            else "?"
        )
        size = f"{r['bytes'] / 1e6:.1f} MB" if "bytes" in r else "?"
        status = "valid" if r["valid"] else "INVALID"
        lines.append(
            f"  step {r['step']:>9}  {status:<7}  {size:>10}  {when}  "
            f"world {r.get('world_size', '?')}"
        )
        if r["valid"]:
            lines.append("      holds: " + ", ".join(r.get("holds", [])))
        else:
            lines.append(f"      why: {r['problem']}")
    use = facts["resume_would_use"]
    newer = next((r for r in reversed(rows) if r["valid"] or r.get("too_new")), None)
    if use:
        lines.append(f"resume would use: {use}")
    elif newer is not None:  # a newer format stops resume before any older checkpoint
        lines.append(f"resume would fail: {newer['problem']}")
    else:
        lines.append("resume would fail: no valid checkpoint")
    if facts["leftovers"]:
        lines.append(
            "leftovers of interrupted saves (removed by the next save): "
            + ", ".join(facts["leftovers"])
        )
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="list a directory's checkpoints: valid or not (and why), step, size, contents",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("path", type=Path, help="a run_dir, a checkpoint root or one step_* dir")
    p.add_argument("--json", action="store_true", help="print the facts as JSON")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    facts = inspect_dir(args.path)
    print(json.dumps(facts, indent=2) if args.json else render(facts))
    if not facts["checkpoints"]:
        return 2
    return 0 if facts["resume_would_use"] else 1
