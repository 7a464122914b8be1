"""``python -m guardrails inspect CKPT_DIR``: what checkpoints a directory holds, which
ones a resume would accept, and what state each carries.

Accepts a run directory (its ``checkpoints/`` is used), a checkpoint root or one
``step_*`` directory. Every checkpoint is listed from its manifest; the ones a resume
would try are verified against it (sizes and sha256, reading each byte once), in
resume's order, up to the first valid one, so the answer to "which one would ``resume``
pick?" is the one :func:`guardrails.resume` would give, at the cost of what resume
reads: the checks are the ones resume runs (:mod:`guardrails.checkpoint.manifest`),
which need no torch, so the command starts without it. ``--verify`` verifies every
checkpoint (hashing 3,000 took minutes; listing them takes a second). Exit code 0 when
resume would find a valid checkpoint, 1 when not, 2 when there is nothing there.

A run saved with a node-local tier (``local_directory``) has copies there too: they are
listed beside the durable ones, marked ``local``, and tried first at the same step as
resume does (``checkpoint/tier.py``). The local directory is the one ``--local`` names,
else the one the newest durable checkpoint's manifest records (when it exists on this
host).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path
from typing import Any

from guardrails.checkpoint import manifest as _manifest
from guardrails.checkpoint import tier as _tier
from guardrails.checkpoint.files import read_json
from guardrails.checkpoint.schema import Bad


def inspect_dir(path: Path, *, verify: bool = False, local: Path | None = None) -> dict[str, Any]:
    """Facts about every checkpoint under ``path`` (JSON-able) and, for a checkpoint
    root, under its node-local tier (``local``, or the one its manifests record). Each
    row is verified (``"verified": True``, ``valid`` and ``problem`` said) when a resume
    would read it (in resume's order up to the first valid one), or with ``verify``
    every row; the others are listed from their manifests (``"valid": None``)."""
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    named = _manifest.STEP_RE.match(path.name)
    if named and path.is_dir():
        found = [(int(named.group(1)), path)]
        local = None
    else:
        local = local if local is not None else _tier.recorded_local(path)
        found = _tier.candidates(path, local)
    entry = not named
    # As resume picks: the newest valid one, in resume's order (the run that saved last
    # first, newest step first); a newer format on the way stops it (an error, not a
    # fall back to an older checkpoint). Verified in that order, up to that one.
    ordered = _manifest.resume_order(found)
    checked: dict[str, dict[str, Any]] = {}
    use = None
    for step, ckpt in ordered:
        r = checked[str(ckpt)] = _one(step, ckpt, entry=entry)
        if r["valid"] or r.get("too_new"):
            use = None if r.get("too_new") else r["path"]
            break
    rows = [
        checked.get(str(ckpt)) or _one(step, ckpt, entry=entry, verify=verify)
        for step, ckpt in sorted(found, key=lambda sp: sp[0])  # stable: local first
    ]
    for row in rows:
        if local is not None:
            row["tier"] = "local" if _tier.in_local(Path(row["path"]), local) else "durable"
    return {
        "root": str(path),
        "local_root": None if local is None else str(local),
        "checkpoints": rows,
        "resume_would_use": use,
        "leftovers": sorted(
            p.name
            for root in (path, *([local] if local is not None else []))
            for p in (root.iterdir() if root.is_dir() else [])
            if p.name.startswith((".tmp-", ".trash-"))
        ),
    }


def _metadata_problem(directory: Path) -> str | None:
    # DCP's metadata is a pickle: only torch's classes can check it, so a sharded
    # checkpoint's inspect imports torch (about 3 s); other checkpoints never do.
    from guardrails.checkpoint import sharded

    return sharded.metadata_problem(directory)


def _one(step: int, ckpt: Path, *, entry: bool, verify: bool = True) -> dict[str, Any]:
    """One checkpoint's row. Nothing here raises on a damaged checkpoint: the damage is
    its ``problem``, and only files the manifest lists, checked, are read. Without
    ``verify``: what its manifest says, read and not verified (``valid`` ``None``)."""
    row: dict[str, Any] = {"step": step, "path": str(ckpt), "verified": verify}
    if not verify:
        row["valid"] = row["problem"] = None
        try:
            manifest = _manifest.read_manifest(ckpt)
        except _manifest.ManifestError as e:  # unreadable: that much is known without hashing
            row.update(verified=True, valid=False, problem=e.message)
            if e.too_new:
                row.update(valid=None, too_new=True, problem=f"{e.message}: {e.hint}")
            return row
        _facts(row, manifest)
        return row
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
    held = _facts(row, manifest)
    ranks = sorted(n for n in files if n.startswith("rank") and n.endswith(".json"))
    if not row["valid"]:  # the files' contents are not read: they are not checked
        row["holds"] = held
        return row
    try:
        if ranks:
            first = read_json(ckpt / ranks[0])  # checked by problem()
            data = first.get("data")
            if data:
                held.append(
                    f"data position (epoch {data['epoch']}, batch {data['batch_in_epoch']}, "
                    f"{data['kind']})"
                )
            if first.get("components"):
                held.append("guard state (" + ", ".join(sorted(first["components"])) + ")")
        if "extras.json" in files:
            extras = read_json(ckpt / "extras.json")
            if extras:
                held.append("extras (" + ", ".join(sorted(extras)) + ")")
    except (OSError, Bad):  # changed since it was checked: say what is known
        pass
    row["holds"] = held
    return row


def _facts(row: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    """What the manifest says (no file read): size, time, versions; returns what the
    checkpoint holds, by the files it lists (also set as the row's ``holds``)."""
    files = manifest["files"]
    row["bytes"] = sum(f["bytes"] for f in files.values())
    row["time"] = manifest.get("time")
    row["world_size"] = manifest.get("world_size")
    row["guardrails"] = manifest.get("guardrails")
    row["torch"] = manifest.get("torch")
    held: list[str] = []
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
    ranks = [n for n in files if n.startswith("rank") and n.endswith(".json")]
    if ranks or "rng.json" in files:
        held.append(f"rng ({len(ranks) or 1} rank{'s' if len(ranks) > 1 else ''})")
    failure = manifest.get("failure")
    if failure:  # a failure save (guards/checkpointer/failure.py): its cause, and if whole
        missing = failure.get("missing") or []
        gaps = f", incomplete: rank(s) {missing} missing" if missing else ""
        held.append(f"failure save after {failure.get('cause')}{gaps}")
    row["holds"] = held
    return held


def render(facts: dict[str, Any]) -> str:
    rows = facts["checkpoints"]
    if not rows:
        return f"no checkpoint under {facts['root']}"
    lines = [f"{len(rows)} checkpoint(s) under {facts['root']}:"]
    if facts.get("local_root"):
        lines[0] = (
            f"{len(rows)} checkpoint(s) under {facts['root']} and its node-local tier "
            f"{facts['local_root']} (marked local):"
        )
    for r in rows:
        when = (
            datetime.datetime.fromtimestamp(r["time"]).strftime("%Y-%m-%d %H:%M:%S")
            if r.get("time")
            else "?"
        )
        size = f"{r['bytes'] / 1e6:.1f} MB" if "bytes" in r else "?"
        status = {True: "valid", False: "INVALID", None: "listed"}[r["valid"]]
        if r.get("too_new"):
            status = "too new"
        lines.append(
            f"  step {r['step']:>9}  {status:<7}  {size:>10}  {when}  "
            f"world {r.get('world_size', '?')}" + ("  local" if r.get("tier") == "local" else "")
        )
        if r["problem"]:
            lines.append(f"      why: {r['problem']}")
        else:
            lines.append("      holds: " + ", ".join(r.get("holds", [])))
    unverified = sum(1 for r in rows if not r["verified"])
    if unverified:
        lines.append(
            f"{unverified} older checkpoint(s) listed from their manifests, not verified "
            "(resume reads none of them while a newer one is valid): "
            "guardrails inspect --verify checks every file of every checkpoint"
        )
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
    p.add_argument(
        "--local",
        type=Path,
        default=None,
        help="the run's node-local checkpoint directory (local_directory), listed too; "
        "by default the one its newest checkpoint records",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="verify every checkpoint (sizes and sha256 of every file; by default only "
        "the ones a resume would read are, up to the first valid one)",
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    local = getattr(args, "local", None)
    facts = inspect_dir(args.path, verify=getattr(args, "verify", False), local=local)
    print(json.dumps(facts, indent=2) if args.json else render(facts))
    if not facts["checkpoints"]:
        return 2
    return 0 if facts["resume_would_use"] else 1
