"""``python -m guardrails inspect CKPT_DIR``: what checkpoints a directory holds, which
ones a resume would accept, and what state each carries.

Accepts a run directory (its ``checkpoints/`` is used), a checkpoint root or one
``step_*`` directory. Every file is verified against the manifest (sizes and sha256,
reading each byte once), so the answer to "which one would ``resume`` pick?" is the
same one :func:`guardrails.resume` would give: the checks are the ones resume runs
(:mod:`guardrails.checkpoint.manifest`), which need no torch, so the command starts without it.
Exit code 0 when at least one checkpoint is valid, 1 when none is, 2 when there is
nothing there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path
from typing import Any

from guardrails.checkpoint import manifest as _manifest


def inspect_dir(path: Path) -> dict[str, Any]:
    """Facts about every checkpoint under ``path`` (JSON-able)."""
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    named = _manifest.STEP_RE.match(path.name)
    if named and path.is_dir():
        found = [(int(named.group(1)), path)]
    else:
        found = _manifest.list_checkpoints(path)
    rows = [_one(step, ckpt, entry=not named) for step, ckpt in found]
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


def _metadata_problem(directory: Path) -> str | None:
    # DCP's metadata is a pickle: only torch's classes can check it, so a sharded
    # checkpoint's inspect imports torch (about 3 s); other checkpoints never do.
    from guardrails.checkpoint import sharded

    return sharded.metadata_problem(directory)


def _one(step: int, ckpt: Path, *, entry: bool) -> dict[str, Any]:
    """One checkpoint's row. Nothing here raises on a damaged checkpoint: the damage is
    its ``problem``, and only files the manifest lists, checked, are read."""
    row: dict[str, Any] = {"step": step, "path": str(ckpt)}
    try:
        problem = _manifest.problem(ckpt, entry=entry, metadata_check=_metadata_problem)
        why = None if problem is None else problem[1]
    except _manifest.ManifestError as e:  # a newer format: resume stops there too
        why = f"{e.message}: {e.hint}"
        row["too_new"] = True
    row["valid"] = why is None
    row["problem"] = why
    if row.get("too_new") or (entry and os.path.islink(ckpt)):
        return row
    try:
        manifest = _manifest.read_manifest(ckpt)
    except _manifest.ManifestError:
        return row
    files = manifest["files"]
    row["bytes"] = sum(f["bytes"] for f in files.values())
    row["time"] = manifest.get("time")
    row["world_size"] = manifest.get("world_size")
    row["guardrails"] = manifest.get("guardrails")
    row["torch"] = manifest.get("torch")
    held = []
    if "model.safetensors" in files:
        held.append("model")
    elif "dcp/.metadata" in files:
        held.append("model (sharded)")
    if "optimizer.json" in files:
        held.append("optimizer")
    if "scheduler.json" in files or "scheduler.pt" in files:
        held.append("scheduler")
    if "scaler.json" in files:
        held.append("scaler")
    ranks = sorted(n for n in files if n.startswith("rank") and n.endswith(".json"))
    if ranks or "rng.json" in files:
        held.append(f"rng ({len(ranks) or 1} rank{'s' if len(ranks) > 1 else ''})")
    if not row["valid"]:  # the files' contents are not read: they are not checked
        row["holds"] = held
        return row
    try:
        if ranks:
            first = _manifest.read_json(ckpt / ranks[0])  # checked by problem()
            data = first.get("data")
            if data:
                held.append(
                    f"data position (epoch {data['epoch']}, batch {data['batch_in_epoch']}, "
                    f"{data['kind']})"
                )
            if first.get("components"):
                held.append("guard state (" + ", ".join(sorted(first["components"])) + ")")
        if "extras.json" in files:
            extras = _manifest.read_json(ckpt / "extras.json")
            if extras:
                held.append("extras (" + ", ".join(sorted(extras)) + ")")
    except (OSError, _manifest.Bad):  # changed since it was checked: say what is known
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
