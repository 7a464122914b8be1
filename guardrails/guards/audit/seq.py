"""One process group's sequence of collectives on this rank, in the form ranks
publish and compare: each call's comparable fields and a 64-bit digest of its key, a
rolling hash over the sequence (anchored every ``ANCHOR_EVERY`` calls), and the last
``WINDOW`` calls shown in a report. Built by the auditor's background thread, never on
the training's.
"""

from __future__ import annotations

import hashlib
from collections import deque
from typing import Any

import torch

WINDOW = 48  # entries per group published each interval (~6 KB of JSON)
HISTORY = 4096  # entries per group kept locally to compare against a lagging neighbour
ANCHOR_EVERY = 64  # a rolling-hash anchor every this many entries, the last 64 published


class _History:
    """One group's sequence on this rank, for the background thread: rolling hash,
    the last HISTORY entries, and anchors (the rolling hash every ANCHOR_EVERY)."""

    def __init__(self, name: str, ranks: list[int], me: int | None = None) -> None:
        self.name = name
        self.ranks = ranks
        # The member this rank compares with: the one just before it in the group
        # (the first member compares with nobody). Each rank's record is read by one
        # peer, so no key has N readers, and every pair of neighbours being compared
        # means any two ranks that differ are seen to.
        members = sorted(ranks)
        at = members.index(me) if me in members else 0
        self.before: int | None = members[at - 1] if at > 0 else None
        # ...and the one after it, also compared at close: a neighbour the backend
        # aborted cannot compare, so each side of it does.
        self.after: int | None = members[at + 1] if at + 1 < len(members) else None
        self.n = 0
        self.cum = 0
        # (seq, key digest, rolling hash, display fields...) newest last
        self.entries: deque[list[Any]] = deque(maxlen=HISTORY)
        self.anchors: deque[tuple[int, int]] = deque(maxlen=64)
        # A call site issues the same call every step: its strings and digest are made
        # once (~1 us per entry then, instead of ~6 us formatting and hashing each).
        self._static: dict[tuple[Any, ...], tuple[dict[str, Any], int]] = {}

    def add(self, entry: tuple[Any, ...]) -> None:
        seq, step, keyed = entry[1], entry[10], entry[11]
        key = (*entry[2:10], keyed)
        cached = self._static.get(key)
        if cached is None:
            if len(self._static) > 4096:
                self._static.clear()
            fields = _fields(entry)
            cached = self._static[key] = (fields, _static_digest(fields))
        fields, static = cached
        step_key = step if keyed else None
        d = _mix(static, step_key)
        self.cum = _chain(self.cum, d)
        self.n = seq
        self.entries.append(_row(seq, d, self.cum, fields, step_key))
        if seq % ANCHOR_EVERY == 0:
            self.anchors.append((seq, self.cum))

    def published(self, *, all_entries: bool = False) -> dict[str, Any]:
        rows = list(self.entries) if all_entries else list(self.entries)[-WINDOW:]
        # The group's size, not its rank list: at 10,000 ranks the list alone is 68 KB.
        return {"size": len(self.ranks), "n": self.n, "anchors": list(self.anchors), "w": rows}

    def diverges_from(self, theirs: dict[str, Any]) -> tuple[int, int] | None:
        """``(first, upto)``: the first entry where the two sequences differ (walked
        back over differing call sites) and the one whose key differs, comparing only
        what both ranks have issued; ``None`` when the common prefix agrees."""
        common = min(self.n, theirs["n"])
        if common <= 0:
            return None
        mine = {row[0]: row for row in self.entries}
        their_rows = {row[0]: row for row in theirs["w"] if row[0] <= common}
        for seq in sorted(their_rows):
            a, b = mine.get(seq), their_rows[seq]
            if a is None or a[1] == b[1]:
                continue
            first = seq
            # Walk back over entries whose keys agree but whose call sites differ: a
            # same-shape extra call first shows as a different line, then as a step.
            while (
                (pa := mine.get(first - 1)) is not None
                and (pb := their_rows.get(first - 1)) is not None
                and pa[1] == pb[1]
                and pa[_SITE] != pb[_SITE]
            ):
                first -= 1
            return first, seq
        # No entry-level difference in the window: the rolling hashes say whether
        # everything before it agrees too.
        theirs_cum = {row[0]: row[2] for row in their_rows.values() if row[2] is not None}
        theirs_cum.update({s: c for s, c in theirs["anchors"] if s <= common})
        for seq in sorted(theirs_cum):
            row = mine.get(seq)
            if row is not None and row[2] != theirs_cum[seq]:
                return seq, seq  # earlier than both windows: the closest we can name
        return None


# Row layout (published as JSON lists): seq, digest, rolling hash, op, shape, dtype,
# reduce op, root, step, site, keyed.
_SITE = 9


def _row(seq: int, d: int, cum: int | None, f: dict[str, Any], step: int | None) -> list[Any]:
    return [
        seq,
        d,
        cum,
        f["op"],
        f.get("shape_shown", f["shape"]),
        f["dtype"],
        f["reduce_op"],
        f["root"],
        step,
        f["site"],
        f["keyed"],
    ]


def _display(row: list[Any]) -> dict[str, Any]:
    return {
        "seq": row[0],
        "op": row[3],
        "shape": row[4],
        "dtype": row[5],
        "reduce_op": row[6],
        "root": row[7],
        "step": row[8],
        "site": row[9],
    }


def _fields(entry: tuple[Any, ...]) -> dict[str, Any]:
    """An entry's comparable, printable fields (strings and ints only)."""
    _, _, op, kind, shape, dtype, red, root, file, line, step, keyed = entry
    if shape is None:
        shape_s = ""
    elif isinstance(shape, torch.Size):
        shape_s = str(list(shape))
    else:
        shape_s = ",".join(str(list(s)) for s in shape)
    return {
        "op": op,
        "kind": kind,
        "shape": "" if kind == "a2a" and shape_s else shape_s,  # split sizes may differ
        "shape_shown": shape_s,
        "dtype": "" if dtype is None else str(dtype).replace("torch.", ""),
        "reduce_op": _red_name(red),
        "root": None if root is None else int(root),
        "step": step if keyed else None,
        "site": f"{file}:{line}" if line else str(file),
        "keyed": keyed,
    }


def _red_name(red: Any) -> str:
    if red is None:
        return ""
    name = getattr(red, "name", None)  # RedOpType.SUM
    if name is None:
        name = str(red).rsplit(".", 1)[-1]
    return str(name).upper()


_MASK = (1 << 64) - 1


def _static_digest(f: dict[str, Any]) -> int:
    """The key's digest without the step. Deterministic across processes (Python's
    ``hash()`` of a str is salted per process)."""
    key = f"{f['op']}|{f['shape']}|{f['dtype']}|{f['reduce_op']}|{f['root']}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def _mix(static: int, step: int | None) -> int:
    if step is None:
        return static
    return static ^ (((step + 1) * 0x9E3779B97F4A7C15) & _MASK)  # golden-ratio spread


def _digest(f: dict[str, Any]) -> int:
    return _mix(_static_digest(f), f["step"])


def _chain(cum: int, d: int) -> int:
    # FNV-1a over 64-bit words: order-sensitive, cheap (~0.2 us), and a consistency
    # check between cooperating ranks needs no cryptographic strength.
    return ((cum ^ d) * 0x100000001B3) & _MASK


def _merge(view: dict[str, Any] | None, ring: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A peer's published record extended with its flight recorder's later entries."""
    view = {"groups": {}} if view is None else view
    groups = view.setdefault("groups", {})
    for name, table in ring.items():
        old = groups.get(name)
        if old is None:
            groups[name] = table
            continue
        seen = {row[0] for row in old["w"]}
        old["w"] = old["w"] + [row for row in table["w"] if row[0] not in seen]
        old["n"] = max(old["n"], table["n"])
    return view
