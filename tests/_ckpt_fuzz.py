"""A seeded fuzz over a real checkpoint: damaged, edited and planted copies, each resumed
four ways, with what every way must do.

Used by ``tests/checkpoint/test_ckpt_fuzz.py`` (a bounded sample) and ``benchmarks/ckpt_fuzz.py``
(every case, with counts). Nothing is mocked: a real guarded run writes the checkpoints
(a small model, AdamW, StepLR, an enabled GradScaler, a DataLoader's position and the
NaN guard's statistics), the copies are real files, links, FIFOs and directories, and
each way is the public API a user calls:

* ``resume(root)``: ``guardrails.resume(run/checkpoints, ...)``;
* ``resume(step)``: ``guardrails.resume(run/checkpoints/step_N, ...)``;
* ``inspect``: ``python -m guardrails inspect``'s function (``inspect.main``);
* ``guard``: ``guardrails.guard(..., resume="auto")`` and two steps of a real loop
  (last: a guarded run writes into the copy, its closing save).

A case damages the newest checkpoint (``step_4``) of a copy whose older one (``step_2``)
is intact, and says what each way must end in: the newest loaded (harmless damage),
the previous one loaded (``resume(root)`` and ``guard`` fall back past an invalid
checkpoint, saying which one they skipped and why), or an error, which must be a
``CheckpointError`` / ``ResumeError`` whose message holds every word of ``says`` (the
file and the field), with the model, optimizer, scheduler, scaler and RNG streams
bitwise as they were. Every way runs under a per-case SIGALRM deadline, so a hang is a
finding, not a stuck suite. Problems are returned as text, never raised, so the
benchmark can count them.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import hashlib
import io
import json
import logging
import os
import pickle
import random
import shutil
import signal
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from conftest import Regressor, read_events

import guardrails
from guardrails.checkpoint.manifest import _self_hash
from guardrails.cli import inspect

NEWEST, PREVIOUS = 4, 2
NEWEST_DIR, PREVIOUS_DIR = f"step_{NEWEST:09d}", f"step_{PREVIOUS:09d}"
WAYS = ("resume(root)", "resume(step)", "inspect", "guard")  # guard last: it writes
#: Batches per epoch of the fuzz's loader (64 samples, batch 8).
LOADER_LEN = 8


class CaseTimeout(Exception):
    """A way did not finish within the case's deadline (a hang)."""


@dataclasses.dataclass
class Case:
    """One damaged copy. ``apply(step_dir, scratch)`` damages ``step_dir`` (the newest
    checkpoint of the copy); ``scratch`` is a directory outside the checkpoint root.
    ``expect``: ``"invalid"`` (the error for the step dir, the previous checkpoint for
    the root and the guard, the reason in inspect), ``"harmless"`` (the newest loads
    everywhere), ``"misfit"`` (intact but does not fit: an error for the three resumes,
    no fallback; inspect calls it valid), ``"too_new"`` (a newer format: an error for
    the three resumes, inspect says so), ``"loader"`` (the data position does not fit
    the loader: only the guard refuses it). ``says``: words every error message and
    every skip reason must hold."""

    kind: str
    name: str
    apply: Callable[[Path, Path], None]
    expect: str = "invalid"
    says: tuple[str, ...] = ()
    #: What a way must end in where it differs from ``expect``'s rule ("newest",
    #: "previous", "error").
    override: dict[str, str] = dataclasses.field(default_factory=dict)
    #: A fallback must be said (a warning, an event) naming the skipped checkpoint.
    warns: bool = True


@dataclasses.dataclass
class Outcome:
    case: Case
    way: str
    result: str  # "newest", "previous", "CheckpointError", "ResumeError", "raw X", "hang", ...
    problems: list[str]
    seconds: float


# ----------------------------------------------------------------------------- the run


def make_run(seed: int) -> tuple[Any, ...]:
    torch.manual_seed(seed)
    model = Regressor()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    return model, opt, sched, scaler


def make_loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 4, generator=g), torch.randn(64, generator=g)
    )
    return torch.utils.data.DataLoader(
        data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1)
    )


def train_step(model: Any, opt: Any, sched: Any, scaler: Any, x: Any, y: Any) -> None:
    scaler.scale(model(x, y)).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    sched.step()


GUARD_KNOBS: dict[str, Any] = {"progress": False, "memory": False, "metrics": False}


def write_run(run_dir: Path) -> None:
    """The pristine run: a guarded loop that saves at steps 2 and 4 (mid-epoch: batch 4
    of 8) and stops there."""
    model, opt, sched, scaler = make_run(0)
    with guardrails.guard(
        model,
        opt,
        make_loader(),
        scheduler=sched,
        scaler=scaler,
        run_dir=run_dir,
        checkpoint={"every_n_steps": 2, "strict_cadence": True, "keep_last": None},
        **GUARD_KNOBS,
    ) as g:
        for x, y in g:
            train_step(model, opt, sched, scaler, x, y)
            if g.step == NEWEST:
                break
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == [PREVIOUS_DIR, NEWEST_DIR], names


def state_of(model: Any, opt: Any, sched: Any, scaler: Any) -> dict[str, Any]:
    """Everything a resume may change, copied: bitwise comparisons of before and after."""
    return copy.deepcopy(
        {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "sched": sched.state_dict(),
            "scaler": scaler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "np_rng": np.random.get_state(legacy=True),
            "py_rng": random.getstate(),
        }
    )


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and (a == b or (a != a and b != b))  # NaN == NaN here


@dataclasses.dataclass
class Pristine:
    """The undamaged run directory and the model weights each checkpoint holds."""

    run_dir: Path
    weights: dict[int, dict[str, torch.Tensor]]

    @property
    def root(self) -> Path:
        return self.run_dir / "checkpoints"


def pristine(run_dir: Path) -> Pristine:
    write_run(run_dir)
    weights = {}
    for step in (PREVIOUS, NEWEST):
        model, opt, sched, scaler = make_run(7)
        guardrails.resume(
            run_dir / "checkpoints" / f"step_{step:09d}", model, opt, scheduler=sched, scaler=scaler
        )
        weights[step] = copy.deepcopy(model.state_dict())
    return Pristine(run_dir, weights)


# ------------------------------------------------------------------------ damage tools


def _manifest(d: Path) -> dict[str, Any]:
    return json.loads((d / "manifest.json").read_text())


def _write_manifest(d: Path, m: dict[str, Any], *, rehash: bool = True) -> None:
    """As someone editing a checkpoint would: the manifest's own checksum recomputed."""
    if rehash and "manifest_sha256" in m:
        m["manifest_sha256"] = _self_hash(m)
    (d / "manifest.json").write_text(json.dumps(m, indent=1))


def _relist(d: Path, name: str) -> None:
    """Record ``name``'s new size and sha256 in the manifest (and rehash it): damage that
    every checksum agrees with, so only the file's own checks can find it."""
    m = _manifest(d)
    data = (d / name).read_bytes()
    m["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    _write_manifest(d, m)


def _edit_json(name: str, edit: Callable[[Any], Any]) -> Callable[[Path, Path], None]:
    def apply(d: Path, scratch: Path) -> None:
        doc = json.loads((d / name).read_text())
        out = edit(doc)
        doc = doc if out is None else out
        (d / name).write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
        _relist(d, name)

    return apply


def _edit_manifest(
    edit: Callable[[dict[str, Any]], Any], *, rehash: bool = True
) -> Callable[[Path, Path], None]:
    def apply(d: Path, scratch: Path) -> None:
        m = _manifest(d)
        out = edit(m)
        m = m if out is None else out
        if isinstance(m, bytes):
            (d / "manifest.json").write_bytes(m)
        else:
            _write_manifest(d, m, rehash=rehash)

    return apply


def _set(path: tuple[Any, ...], value: Any) -> Callable[[Any], None]:
    def edit(doc: Any) -> None:
        for k in path[:-1]:
            doc = doc[k]
        doc[path[-1]] = value

    return edit


def _drop(path: tuple[Any, ...]) -> Callable[[Any], None]:
    def edit(doc: Any) -> None:
        for k in path[:-1]:
            doc = doc[k]
        del doc[path[-1]]

    return edit


def _deep(depth: int) -> Any:
    """JSON nested ``depth`` lists deep (Python's json recurses once per level)."""
    return json.loads("[" * depth + "]" * depth)


def _deep_raw(doc_key: str, depth: int) -> Callable[[Any], bytes]:
    def edit(doc: Any) -> bytes:
        doc[doc_key] = "@DEEP@"
        return json.dumps(doc).encode().replace(b'"@DEEP@"', b"[" * depth + b"]" * depth)

    return edit


def _truncate(name: str, keep: Callable[[int], int]) -> Callable[[Path, Path], None]:
    def apply(d: Path, scratch: Path) -> None:
        raw = (d / name).read_bytes()
        (d / name).write_bytes(raw[: keep(len(raw))])

    return apply


def _flip_bit(name: str, bit: int) -> Callable[[Path, Path], None]:
    def apply(d: Path, scratch: Path) -> None:
        raw = bytearray((d / name).read_bytes())
        raw[(bit // 8) % len(raw)] ^= 1 << (bit % 8)
        (d / name).write_bytes(bytes(raw))

    return apply


def _set_byte(name: str, pos: int, value: int) -> Callable[[Path, Path], None]:
    def apply(d: Path, scratch: Path) -> None:
        raw = bytearray((d / name).read_bytes())
        i = pos % len(raw)
        raw[i] = value if raw[i] != value else (value + 1) % 256
        (d / name).write_bytes(bytes(raw))

    return apply


def _delete(name: str) -> Callable[[Path, Path], None]:
    return lambda d, scratch: (d / name).unlink()


def _replace_with(name: str, how: str) -> Callable[[Path, Path], None]:
    """Replace ``name`` in the checkpoint: a link to an identical copy outside / inside,
    a link to itself, a dangling link, a FIFO, a directory."""

    def apply(d: Path, scratch: Path) -> None:
        f = d / name
        data = f.read_bytes()
        f.unlink()
        if how == "link_out":
            target = scratch / f"copy-of-{name}"
            target.write_bytes(data)  # same bytes: the manifest's size and sha256 match
            f.symlink_to(target)
        elif how == "link_in":
            target = d / f"{name}.copy"
            target.write_bytes(data)
            f.symlink_to(target.name)
        elif how == "link_loop":
            f.symlink_to(f.name)
        elif how == "link_dangling":
            f.symlink_to(scratch / "nothing-here")
        elif how == "fifo":
            os.mkfifo(f)
        elif how == "dir":
            f.mkdir()
            (f / "x").write_bytes(data)
        else:
            raise ValueError(how)

    return apply


def _step_dir_link(d: Path, scratch: Path) -> None:
    """The newest step directory is a link to an identical copy elsewhere."""
    target = scratch / "elsewhere" / d.name
    shutil.copytree(d, target)
    shutil.rmtree(d)
    d.symlink_to(target, target_is_directory=True)


def _step_dir_file(d: Path, scratch: Path) -> None:
    shutil.rmtree(d)
    d.write_bytes(b"not a directory")


def _unlisted_model(d: Path, scratch: Path) -> None:
    """The manifest stops listing model.safetensors, whose bytes are then damaged: a
    checkpoint whose manifest holds no model; the file must never be read."""
    m = _manifest(d)
    del m["files"]["model.safetensors"]
    _write_manifest(d, m)
    raw = bytearray((d / "model.safetensors").read_bytes())
    raw[8:16] = b"\xff" * 8  # into the safetensors header: unreadable if read
    (d / "model.safetensors").write_bytes(bytes(raw))


def _unlisted_extra(name: str, data: bytes | None) -> Callable[[Path, Path], None]:
    def apply(d: Path, scratch: Path) -> None:
        f = d / name
        f.parent.mkdir(parents=True, exist_ok=True)
        if data is None:
            os.mkfifo(f)
        else:
            f.write_bytes(data)

    return apply


class _Planted:
    """A pickle whose loading runs code (writes a marker file)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (Path(self.marker), "code ran"))


def _plant_dcp(payload: Callable[[Path], bytes]) -> Callable[[Path, Path], None]:
    def apply(d: Path, scratch: Path) -> None:
        (d / "dcp").mkdir()
        (d / "dcp" / ".metadata").write_bytes(payload(scratch))
        m = _manifest(d)
        data = (d / "dcp" / ".metadata").read_bytes()
        m["files"]["dcp/.metadata"] = {
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        _write_manifest(d, m)

    return apply


def _safetensors_header(
    name: str, edit: Callable[[dict[str, Any]], Any]
) -> Callable[[Path, Path], None]:
    """Rewrite a .safetensors file's JSON header (then relist it)."""

    def apply(d: Path, scratch: Path) -> None:
        raw = (d / name).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        out = edit(header)
        body = out if isinstance(out, bytes) else json.dumps(header).encode()
        (d / name).write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])
        _relist(d, name)

    return apply


def _header_len(name: str, n: int) -> Callable[[Path, Path], None]:
    def apply(d: Path, scratch: Path) -> None:
        raw = (d / name).read_bytes()
        (d / name).write_bytes(struct.pack("<Q", n) + raw[8:])
        _relist(d, name)

    return apply


# ------------------------------------------------------------------------------ cases


LISTED = (
    "manifest.json",
    "model.safetensors",
    "optimizer.safetensors",
    "optimizer.json",
    "scheduler.json",
    "scaler.json",
    "extras.json",
    "rank00000.json",
    "rank00000.safetensors",
)


def cases(rng: random.Random, sizes: dict[str, int], *, flips_per_file: int = 3) -> list[Case]:
    """Every case, in a fixed order for a given ``rng`` seed. ``sizes``: each listed
    file's size in the pristine newest checkpoint (bit positions are drawn within it)."""
    out: list[Case] = []

    def add(
        kind: str,
        name: str,
        apply: Callable[[Path, Path], None],
        expect: str = "invalid",
        *says: str,
    ) -> None:
        out.append(Case(kind, name, apply, expect, says))

    for f in LISTED:
        for label, keep in (
            ("empty", lambda n: 0),
            ("half", lambda n: n // 2),
            ("one byte short", lambda n: n - 1),
        ):
            add("truncate", f"{f} {label}", _truncate(f, keep), "invalid", f)
    for f in LISTED:
        for _ in range(flips_per_file):
            bit = rng.randrange(sizes[f] * 8)
            add("bitflip", f"{f} bit {bit}", _flip_bit(f, bit), "invalid", f)
        for _ in range(flips_per_file):
            pos, value = rng.randrange(sizes[f]), rng.randrange(256)
            add("byteflip", f"{f} byte {pos}={value}", _set_byte(f, pos, value), "invalid", f)
    for f in LISTED:
        add("delete", f, _delete(f), "invalid", f)

    # The manifest's fields, edited without and with its own checksum recomputed.
    edits: list[tuple[str, Callable[[Any], Any], str]] = [
        ("step 4 -> 5", _set(("step",), 5), "step"),
        ("step 4 -> 2", _set(("step",), 2), "step"),
        ("step -1", _set(("step",), -1), "step"),
        ("step '4'", _set(("step",), "4"), "step"),
        ("step 4.5", _set(("step",), 4.5), "step"),
        ("step true", _set(("step",), True), "step"),
        ("step 10**30", _set(("step",), 10**30), "step"),
        ("step NaN", _set(("step",), float("nan")), "step"),
        ("format other", _set(("format",), "other-format"), "format"),
        ("format_version 0", _set(("format_version",), 0), "format_version"),
        ("format_version '4'", _set(("format_version",), "4"), "format_version"),
        ("format_version -3", _set(("format_version",), -3), "format_version"),
        ("format_version 10**30", _set(("format_version",), 10**30), "format_version"),
        ("world_size 0", _set(("world_size",), 0), "world_size"),
        ("world_size '1'", _set(("world_size",), "1"), "world_size"),
        ("world_size 10**30", _set(("world_size",), 10**30), "world_size"),
        ("ranks 'x'", _set(("ranks",), "x"), "ranks"),
        ("files []", _set(("files",), []), "files"),
        (
            "files renamed",
            lambda m: m["files"].__setitem__(
                "model2.safetensors", m["files"].pop("model.safetensors")
            ),
            "model2.safetensors",
        ),
        (
            "files extra entry",
            _set(("files", "ghost.json"), {"bytes": 2, "sha256": "0" * 64}),
            "ghost.json",
        ),
        (
            "files dotdot",
            lambda m: m["files"].__setitem__("../x.json", m["files"].pop("extras.json")),
            "../x.json",
        ),
        (
            "files absolute",
            lambda m: m["files"].__setitem__("/etc/passwd", {"bytes": 1, "sha256": "0" * 64}),
            "/etc/passwd",
        ),
        ("files empty name", _set(("files", ""), {"bytes": 0, "sha256": "0" * 64}), "files"),
        ("files entry a string", _set(("files", "scaler.json"), "x"), "scaler.json"),
        (
            "bytes +1",
            lambda m: m["files"]["model.safetensors"].__setitem__(
                "bytes", m["files"]["model.safetensors"]["bytes"] + 1
            ),
            "bytes",
        ),
        ("bytes -1", _set(("files", "model.safetensors", "bytes"), -1), "bytes"),
        ("bytes '940'", _set(("files", "model.safetensors", "bytes"), "940"), "bytes"),
        ("bytes 10**30", _set(("files", "model.safetensors", "bytes"), 10**30), "bytes"),
        ("bytes missing", _drop(("files", "model.safetensors", "bytes")), "bytes"),
        (
            "sha256 one digit",
            lambda m: m["files"]["optimizer.json"].__setitem__(
                "sha256", "f" + m["files"]["optimizer.json"]["sha256"][1:]
            ),
            "optimizer.json",
        ),
        ("sha256 ''", _set(("files", "optimizer.json", "sha256"), ""), "sha256"),
        ("sha256 123", _set(("files", "optimizer.json", "sha256"), 123), "sha256"),
        ("sha256 missing", _drop(("files", "optimizer.json", "sha256")), "sha256"),
        (
            "chunk bytes 0",
            _set(("files", "model.safetensors", "sha256_chunk_bytes"), 0),
            "sha256_chunk_bytes",
        ),
        (
            "chunk bytes 'x'",
            _set(("files", "model.safetensors", "sha256_chunk_bytes"), "x"),
            "sha256_chunk_bytes",
        ),
        (
            "chunk bytes 2**70",
            _set(("files", "model.safetensors", "sha256_chunk_bytes"), 2**70),
            "sha256_chunk_bytes",
        ),
        ("contents []", _set(("contents",), []), "contents"),
        (
            "contents optimizer file dotdot",
            _set(("contents", "optimizers", "optimizer", "file"), "../../x"),
            "file",
        ),
        (
            "contents optimizer file 5",
            _set(("contents", "optimizers", "optimizer", "file"), 5),
            "file",
        ),
        (
            "contents per_rank 'yes'",
            _set(("contents", "optimizers", "optimizer", "per_rank"), "yes"),
            "per_rank",
        ),
        ("contents scheduler 7", _set(("contents", "schedulers", "scheduler"), 7), "schedulers"),
        ("contents classes []", _set(("contents", "classes"), []), "classes"),
        ("run []", _set(("run",), []), "run"),
        ("time 'noon'", _set(("time",), "noon"), "time"),
    ]
    for label, edit, field in edits:
        add(
            "manifest",
            f"{label}, unhashed",
            _edit_manifest(edit, rehash=False),
            "invalid",
            "manifest.json",
            "checksum",
        )
        add(
            "manifest",
            f"{label}, rehashed",
            _edit_manifest(edit),
            "invalid",
            "manifest.json",
            field,
        )
    add(
        "manifest",
        "manifest_sha256 wrong",
        _set_manifest_hash("0" * 64),
        "invalid",
        "manifest.json",
        "checksum",
    )
    add(
        "manifest",
        "manifest_sha256 42",
        _set_manifest_hash(42),
        "invalid",
        "manifest.json",
        "manifest_sha256",
    )

    # Schema: missing keys, extra keys, huge and negative numbers, bytes that are not
    # UTF-8, nesting deeper than a parser recurses.
    for key in ("format", "format_version", "step", "files"):
        add(
            "schema",
            f"manifest without {key}",
            _edit_manifest(_drop((key,))),
            "invalid",
            "manifest.json",
            key,
        )
    add(
        "schema",
        "manifest not an object",
        _edit_manifest(lambda m: b"[1, 2, 3]"),
        "invalid",
        "manifest.json",
    )
    add(
        "schema",
        "manifest not UTF-8",
        _edit_manifest(lambda m: json.dumps(m).encode().replace(b'"step"', b'"st\xffep"')),
        "invalid",
        "manifest.json",
        "UTF-8",
    )
    add(
        "schema",
        "manifest nested 100000 deep",
        _edit_manifest(_deep_raw("run", 100_000)),
        "invalid",
        "manifest.json",
    )
    add(
        "schema",
        "manifest NaN literal",
        _edit_manifest(lambda m: json.dumps(m).encode().replace(b'"step": 4', b'"step": NaN')),
        "invalid",
        "manifest.json",
        "step",
    )
    add(
        "schema",
        "manifest duplicate key",
        _edit_manifest(
            lambda m: json.dumps(m).encode().replace(b'"step": 4', b'"step": 4, "step": 5')
        ),
        "invalid",
        "manifest.json",
        "step",
    )
    # A contents table without its optimizers (commit(contents=None) writes {}): read
    # from the file names, as formats 1-2 are.
    add(
        "schema",
        "contents without optimizers",
        _edit_manifest(_drop(("contents", "optimizers"))),
        "harmless",
    )
    add(
        "schema",
        "manifest extra top-level key",
        _edit_manifest(_set(("future_field",), {"x": 1})),
        "harmless",
    )
    add(
        "schema",
        "manifest extra key in a file entry",
        _edit_manifest(_set(("files", "model.safetensors", "future"), 1)),
        "harmless",
    )

    # Files whose every checksum agrees (someone edited them and relisted them): only
    # their own checks can find what is wrong.
    rank = "rank00000.json"
    for label, edit, field in [
        ("data.batch_in_epoch -1", _set(("data", "batch_in_epoch"), -1), "batch_in_epoch"),
        ("data.batch_in_epoch '4'", _set(("data", "batch_in_epoch"), "4"), "batch_in_epoch"),
        ("data.batch_in_epoch 10**30", _set(("data", "batch_in_epoch"), 10**30), "batch_in_epoch"),
        ("data.epoch -1", _set(("data", "epoch"), -1), "epoch"),
        ("data.epoch 4.5", _set(("data", "epoch"), 4.5), "epoch"),
        ("data.kind 'teleport'", _set(("data", "kind"), "teleport"), "kind"),
        ("data missing batch_in_epoch", _drop(("data", "batch_in_epoch")), "batch_in_epoch"),
        ("data a list", _set(("data",), [1, 2]), "data"),
        ("rng missing", _drop(("rng",)), "rng"),
        (
            "rng.python short",
            lambda d: d["rng"].__setitem__("python", d["rng"]["python"][:2]),
            "python",
        ),
        (
            "rng.python state short",
            lambda d: d["rng"]["python"].__setitem__(1, d["rng"]["python"][1][:10]),
            "python",
        ),
        ("rng.numpy 'x'", _set(("rng", "numpy"), "x"), "numpy"),
        ("rng.numpy keys short", lambda d: d["rng"]["numpy"].__setitem__(1, [1, 2, 3]), "numpy"),
        ("components.nan a string", _set(("components", "nan"), "x"), "nan"),
        ("components a list", _set(("components",), [1]), "components"),
        ("step 'x'", _set(("step",), "x"), "step"),
        ("rank 3", _set(("rank",), 3), "rank"),
        ("not an object", lambda d: [1, 2], rank),
        ("nested 100000 deep", _deep_raw("components", 100_000), rank),
        (
            "not UTF-8",
            lambda d: json.dumps(d).encode().replace(b'"data"', b'"da\xfe\xfeta"'),
            "UTF-8",
        ),
        ("not JSON", lambda d: b"{'python': dict}", rank),
    ]:
        add("content", f"{rank} {label}", _edit_json(rank, edit), "invalid", rank, field)
    add(
        "loader",
        f"{rank} data.batch_in_epoch 10**12",
        _edit_json(rank, _set(("data", "batch_in_epoch"), 10**12)),
        "loader",
        "1000000000000",
        str(LOADER_LEN),
    )
    add(
        "loader",
        f"{rank} data.batch_in_epoch 9",
        _edit_json(rank, _set(("data", "batch_in_epoch"), LOADER_LEN + 1)),
        "loader",
        str(LOADER_LEN + 1),
        str(LOADER_LEN),
    )
    opt = "optimizer.json"
    for label, edit, field in [
        ("state key 'x'", lambda d: d["state"].__setitem__("x", d["state"].pop("0")), "state"),
        ("state key '-1'", lambda d: d["state"].__setitem__("-1", d["state"].pop("0")), "state"),
        (
            "state key 10**30",
            lambda d: d["state"].__setitem__(str(10**30), d["state"].pop("0")),
            "state",
        ),
        (
            "tensor ref missing",
            lambda d: d["state"]["0"].__setitem__("exp_avg", {"__tensor__": "nope"}),
            "nope",
        ),
        ("state a list", _set(("state",), [1]), "state"),
        ("param_groups missing", _drop(("param_groups",)), "param_groups"),
        ("param_groups a dict", _set(("param_groups",), {"a": 1}), "param_groups"),
        ("lr a string", lambda d: d["param_groups"][0].__setitem__("lr", "0.01"), "lr"),
        ("lr -> None", lambda d: d["param_groups"][0].__setitem__("lr", None), "lr"),
        (
            "betas one long",
            lambda d: d["param_groups"][0].__setitem__("betas", {"__tuple__": [0.9]}),
            "betas",
        ),
        ("params 'x'", lambda d: d["param_groups"][0].__setitem__("params", "x"), "params"),
        (
            "params out of range",
            lambda d: d["param_groups"][0]["params"].__setitem__(0, 10**6),
            "params",
        ),
        (
            "param_shapes short",
            lambda d: d.__setitem__("param_shapes", d["param_shapes"][:1]),
            "param_shapes",
        ),
        ("param_shapes 'x'", _set(("param_shapes",), "x"), "param_shapes"),
        ("step a string", lambda d: d["state"]["0"].__setitem__("step", "x"), "step"),
        ("nested 100000 deep", _deep_raw("state", 100_000), opt),
    ]:
        add("content", f"{opt} {label}", _edit_json(opt, edit), "invalid", opt, field)
    for label, edit, field in [
        ("last_epoch 'x'", _set(("last_epoch",), "x"), "last_epoch"),
        ("base_lrs []", _set(("base_lrs",), []), "base_lrs"),
        ("gamma None", _set(("gamma",), None), "gamma"),  # StepLR's own: inspect cannot tell
        ("not an object", lambda d: [1], "scheduler.json"),
    ]:
        add(
            "content",
            f"scheduler.json {label}",
            _edit_json("scheduler.json", edit),
            "invalid",
            "scheduler.json",
            field,
        )
        if label == "gamma None":  # a field of StepLR's own: only the live scheduler tells
            out[-1].override["inspect"] = "valid"
    for label, edit, field in [
        ("scale 'x'", _set(("scale",), "x"), "scale"),
        ("scale -1", _set(("scale",), -1.0), "scale"),
        ("growth_tracker 1.5", _set(("_growth_tracker",), 1.5), "_growth_tracker"),
    ]:
        add(
            "content",
            f"scaler.json {label}",
            _edit_json("scaler.json", edit),
            "invalid",
            "scaler.json",
            field,
        )
    # A disabled scaler's state ({}) into an enabled scaler: intact, but not this run's.
    add(
        "misfit",
        "scaler.json empty",
        _edit_json("scaler.json", lambda d: {}),
        "misfit",
        "disabled GradScaler",
    )
    add(
        "content",
        "extras.json a list",
        _edit_json("extras.json", lambda d: [1]),
        "invalid",
        "extras.json",
    )
    add(
        "content",
        "extras.json nested 100000 deep",
        _edit_json("extras.json", _deep_raw("x", 100_000)),
        "invalid",
        "extras.json",
    )
    add(
        "content",
        "extras.json a big number",
        _edit_json("extras.json", lambda d: b'{"n": 1' + b"0" * 5000 + b"}"),
        "invalid",
        "extras.json",
    )
    add(
        "content",
        "extras.json user values",
        _edit_json("extras.json", lambda d: {"best": 1.5, "tags": ["a"]}),
        "harmless",
    )
    for f in ("model.safetensors", "optimizer.safetensors", "rank00000.safetensors"):
        add("content", f"{f} header length 2**63", _header_len(f, 2**63), "invalid", f)
        add("content", f"{f} header length 0", _header_len(f, 0), "invalid", f)
        add(
            "content",
            f"{f} header not JSON",
            _safetensors_header(f, lambda h: b"{not json" + b" " * 7),
            "invalid",
            f,
        )
        add("content", f"{f} header dtype F64", _safetensors_header(f, _retype), "invalid", f)
        add(
            "content",
            f"{f} header offsets past the end",
            _safetensors_header(f, _overrun),
            "invalid",
            f,
        )
        add(
            "content",
            f"{f} aliases not JSON",
            _safetensors_header(f, _bad_aliases),
            "invalid",
            f,
            "guardrails.aliases",
        )
    add(
        "content",
        "rank00000.safetensors torch.cpu rng a float tensor",
        _rng_as_float,
        "invalid",
        "rank00000.safetensors",
        "torch.cpu",
    )
    add(
        "misfit",
        "model.safetensors a key renamed",
        _safetensors_header("model.safetensors", _rename_key),
        "misfit",
        "net.0.weight",
    )
    # Another class's state (saved from SGD, LambdaLR): refused by name, before anything.
    for key, cls in (("optimizer:optimizer", "SGD"), ("scheduler:scheduler", "LambdaLR")):
        add(
            "misfit",
            f"contents.classes {key} {cls}",
            _edit_manifest(_set(("contents", "classes", key), cls)),
            "misfit",
            cls,
        )
    add(
        "misfit",
        "optimizer.safetensors exp_avg another shape",
        _exp_avg_reshaped,
        "invalid",
        "optimizer",
        "exp_avg",
    )

    # Files the manifest does not list: never read.
    add("unlisted", "model.safetensors unlisted and damaged", _unlisted_model, "misfit", "model")
    add("unlisted", "junk file", _unlisted_extra("notes.txt", b"hello"), "harmless")
    add(
        "unlisted",
        "junk model file in a subdirectory",
        _unlisted_extra("old/model.safetensors", b"\xff" * 64),
        "harmless",
    )
    add("unlisted", "a FIFO", _unlisted_extra("pipe", None), "harmless")
    add("unlisted", "rank00001.json", _unlisted_extra("rank00001.json", b"{bad"), "harmless")

    for f in ("manifest.json", "model.safetensors", "rank00000.json"):
        add(
            "symlink",
            f"{f} -> identical file outside",
            _replace_with(f, "link_out"),
            "invalid",
            f,
            "link",
        )
        add(
            "symlink",
            f"{f} -> identical file inside",
            _replace_with(f, "link_in"),
            "invalid",
            f,
            "link",
        )
        add("symlink", f"{f} -> itself", _replace_with(f, "link_loop"), "invalid", f, "link")
        add("symlink", f"{f} -> nowhere", _replace_with(f, "link_dangling"), "invalid", f, "link")
        add("fifo", f"{f} a FIFO", _replace_with(f, "fifo"), "invalid", f, "not a regular file")
        add(
            "directory",
            f"{f} a directory",
            _replace_with(f, "dir"),
            "invalid",
            f,
            "not a regular file",
        )
    # A step directory named explicitly is the user's choice (a "latest" link is one);
    # found under the root, a link is skipped like a linked file.
    add(
        "symlink",
        "step dir -> identical dir outside",
        _step_dir_link,
        "invalid",
        NEWEST_DIR,
        "link",
    )
    out[-1].override["resume(step)"] = "newest"
    # Not a directory: not a checkpoint at all, so nothing is skipped.
    add("directory", "step dir a file", _step_dir_file, "invalid", "not a directory")
    out[-1].warns = False

    add(
        "dcp",
        "planted pickle",
        _plant_dcp(lambda s: pickle.dumps(_Planted(str(s / "pwned")))),
        "invalid",
        ".metadata",
        "refusing",
    )
    add("dcp", "garbage metadata", _plant_dcp(lambda s: b"\x80\x05garbage"), "invalid", ".metadata")
    add(
        "dcp",
        "a pickled dict",
        _plant_dcp(lambda s: pickle.dumps({"a": 1})),
        "invalid",
        ".metadata",
    )

    add(
        "too_new",
        "format_version 5",
        _edit_manifest(_set(("format_version",), 5)),
        "too_new",
        "format 5",
        "upgrade",
    )
    add(
        "manifest",
        "format_version 5, unhashed",
        _edit_manifest(_set(("format_version",), 5), rehash=False),
        "invalid",
        "manifest.json",
        "checksum",
    )
    return out


def _set_manifest_hash(value: Any) -> Callable[[Path, Path], None]:
    def apply(d: Path, scratch: Path) -> None:
        m = _manifest(d)
        m["manifest_sha256"] = value
        (d / "manifest.json").write_text(json.dumps(m))

    return apply


def _retype(h: dict[str, Any]) -> None:
    for k, v in h.items():
        if k != "__metadata__":
            v["dtype"] = "F64"
            return


def _overrun(h: dict[str, Any]) -> None:
    for k, v in h.items():
        if k != "__metadata__":
            v["data_offsets"][1] += 10**6
            return


def _bad_aliases(h: dict[str, Any]) -> None:
    h.setdefault("__metadata__", {})["guardrails.aliases"] = "{not json"


def _rename_key(h: dict[str, Any]) -> None:
    h["net.0.renamed"] = h.pop("net.0.weight")


def _rng_as_float(d: Path, scratch: Path) -> None:
    from safetensors.torch import load_file, save_file

    f = d / "rank00000.safetensors"
    tensors = load_file(str(f))
    tensors["torch.cpu"] = tensors["torch.cpu"].float()
    save_file(tensors, str(f), metadata={"guardrails.aliases": "{}"})
    _relist(d, f.name)


def _exp_avg_reshaped(d: Path, scratch: Path) -> None:
    """One exp_avg saved with another shape than its parameter (the file relisted)."""
    from safetensors.torch import load_file, save_file

    f = d / "optimizer.safetensors"
    tensors = load_file(str(f))
    key = next(k for k in sorted(tensors) if k.endswith("exp_avg"))
    tensors[key] = tensors[key].reshape(-1)[:3].clone()
    save_file(tensors, str(f), metadata={"guardrails.aliases": "{}"})
    _relist(d, f.name)


# ------------------------------------------------------------------------------- ways


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise CaseTimeout in the main thread after ``seconds`` (SIGALRM): an open() of a
    FIFO or an endless fast-forward is interrupted, and reported as a hang."""

    def fire(signum: int, frame: Any) -> None:
        raise CaseTimeout(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    t0 = time.monotonic()
    outer, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:  # someone else's timer (pytest-timeout's): give back what is left of it
            left = max(outer - (time.monotonic() - t0), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, interval)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _error_problems(
    case: Case, way: str, e: BaseException, before: dict[str, Any], after: dict[str, Any]
) -> tuple[str, list[str]]:
    problems = []
    if isinstance(e, CaseTimeout):
        return "hang", [f"{way}: hung ({e})"]
    if not isinstance(e, guardrails.CheckpointError | guardrails.ResumeError):
        return f"raw {type(e).__name__}", [f"{way}: raw {type(e).__name__}: {str(e)[:300]}"]
    msg = str(e)
    missing = [w for w in case.says if w.lower() not in msg.lower()]
    if missing:
        problems.append(f"{way}: the message lacks {missing}: {msg[:400]}")
    if not e.hint:
        problems.append(f"{way}: {type(e).__name__} says nothing to do (no hint): {msg[:300]}")
    if not same(before, after):
        changed = [k for k in before if not same(before[k], after[k])]
        problems.append(f"{way}: refused, but {changed} changed")
    return type(e).__name__, problems


def _which(model: Any, pristine_: Pristine) -> str:
    sd = model.state_dict()
    for step, label in ((NEWEST, "newest"), (PREVIOUS, "previous")):
        if same(sd, pristine_.weights[step]):
            return label
    return "other"


def way_resume(
    case: Case, pristine_: Pristine, path: Path, way: str, timeout_s: float
) -> tuple[str, list[str]]:
    model, opt, sched, scaler = make_run(123)
    before = state_of(model, opt, sched, scaler)
    handler = _Records()
    logger = logging.getLogger("guardrails")
    logger.addHandler(handler)
    try:
        with deadline(timeout_s):
            out = guardrails.resume(path, model, opt, scheduler=sched, scaler=scaler)
    except BaseException as e:  # what escapes is the finding
        if isinstance(e, KeyboardInterrupt):
            raise
        result, problems = _error_problems(
            case, way, e, before, state_of(model, opt, sched, scaler)
        )
        wanted = _wanted(case, way)
        if wanted != "error" and result in ("CheckpointError", "ResumeError"):
            problems.append(f"{way}: {result} where {wanted} should load: {str(e)[:300]}")
        return result, problems
    finally:
        logger.removeHandler(handler)
    got = _which(model, pristine_)
    problems = []
    wanted = _wanted(case, way)
    if got != wanted:
        problems.append(f"{way}: loaded {got} (step {out['step']}), expected {wanted}")
    if got == "previous" and case.warns:
        skipped = [
            r.getMessage()
            for r in handler.records
            if r.levelno >= logging.WARNING and NEWEST_DIR in r.getMessage()
        ]
        if not skipped:
            problems.append(f"{way}: fell back without a warning naming {NEWEST_DIR}")
        elif not all(any(w.lower() in m.lower() for m in skipped) for w in case.says):
            problems.append(f"{way}: the skip warning lacks {case.says}: {skipped[0][:300]}")
    return got, problems


def _wanted(case: Case, way: str) -> str:
    if way in case.override:
        return case.override[way]
    if case.expect == "harmless":
        return "newest"
    if case.expect == "invalid":
        return "error" if way == "resume(step)" else "previous"
    if case.expect == "loader":
        return "error" if way == "guard" else "newest"
    return "error"  # misfit, too_new


def way_guard(
    case: Case, pristine_: Pristine, run_dir: Path, timeout_s: float
) -> tuple[str, list[str]]:
    model, opt, sched, scaler = make_run(123)
    before = state_of(model, opt, sched, scaler)
    wanted = _wanted(case, "guard")
    try:
        with deadline(timeout_s):
            g = guardrails.guard(
                model,
                opt,
                make_loader(),
                scheduler=sched,
                scaler=scaler,
                run_dir=run_dir,
                resume="auto",
                checkpoint={"save_on_signal": False},
                **GUARD_KNOBS,
            )
            with g:
                got = _which(model, pristine_)
                start = g.step
                for n, (x, y) in enumerate(g):
                    train_step(model, opt, sched, scaler, x, y)
                    if n == 1:
                        break
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        result, problems = _error_problems(
            case, "guard", e, before, state_of(model, opt, sched, scaler)
        )
        if wanted != "error" and result in ("CheckpointError", "ResumeError"):
            problems.append(f"guard: {result} where {wanted} should load: {str(e)[:300]}")
        return result, problems
    problems = []
    if got != wanted:
        problems.append(f"guard: resumed {got} (step {start}), expected {wanted}")
    if got == "previous" and case.warns:
        events = read_events(run_dir)
        skips = [e for e in events if e.get("kind") == "checkpoint_invalid"]
        text = " ".join(e.get("message", "") for e in skips)
        if not skips or NEWEST_DIR not in text:
            problems.append(
                f"guard: fell back without a checkpoint_invalid event naming {NEWEST_DIR}"
            )
        elif not all(w.lower() in text.lower() for w in case.says):
            problems.append(f"guard: the skip event lacks {case.says}: {text[:300]}")
    return got, problems


def way_inspect(case: Case, root: Path, timeout_s: float) -> tuple[str, list[str]]:
    out = io.StringIO()
    try:
        with deadline(timeout_s), contextlib.redirect_stdout(out):
            code = inspect.main(argparse.Namespace(path=root, json=False))
            facts = inspect.inspect_dir(root)
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        if isinstance(e, CaseTimeout):
            return "hang", [f"inspect: hung ({e})"]
        return f"raw {type(e).__name__}", [f"inspect: raised {type(e).__name__}: {str(e)[:300]}"]
    rows = {Path(r["path"]).name: r for r in facts["checkpoints"]}
    text = out.getvalue()
    problems = []
    newest = rows.get(NEWEST_DIR)
    use = facts["resume_would_use"]
    use = Path(use).name if use else None
    if case.expect in ("harmless", "misfit", "loader") or case.override.get("inspect") == "valid":
        result = "valid" if newest and newest["valid"] else "invalid"
        if result != "valid":
            problems.append(f"inspect: calls the newest invalid: {newest and newest['problem']}")
        if use != NEWEST_DIR or code != 0:
            problems.append(f"inspect: resume would use {use} (exit {code}), expected {NEWEST_DIR}")
        return result, problems
    if newest is None:  # the step dir is no longer a directory: not listed at all
        result = "not listed"
        if case.name != "step dir a file":
            problems.append("inspect: the newest checkpoint is not listed")
    else:
        result = "invalid" if not newest["valid"] else "valid"
        if newest["valid"]:
            problems.append("inspect: calls the damaged checkpoint valid")
        why = newest["problem"] or ""
        missing = [w for w in case.says if w.lower() not in why.lower()]
        if missing:
            problems.append(f"inspect: the reason lacks {missing}: {why[:300]}")
        if why and f"why: {why}" not in text:
            problems.append("inspect: the reason is not printed")
    expected_use = None if case.expect == "too_new" else PREVIOUS_DIR
    if use != expected_use:
        problems.append(f"inspect: resume would use {use}, expected {expected_use}")
    return result, problems


def run_case(
    case: Case,
    pristine_: Pristine,
    work: Path,
    *,
    ways: tuple[str, ...] = WAYS,
    timeout_s: float = 20.0,
) -> list[Outcome]:
    """Damage a fresh copy of the pristine run as ``case`` says and try every way."""
    if work.exists():
        shutil.rmtree(work)
    run_dir, scratch = work / "run", work / "scratch"
    scratch.mkdir(parents=True)
    shutil.copytree(pristine_.root, run_dir / "checkpoints", symlinks=True)
    step_dir = run_dir / "checkpoints" / NEWEST_DIR
    case.apply(step_dir, scratch)
    outcomes = []
    for way in ways:
        t0 = time.perf_counter()
        if way == "resume(root)":
            result, problems = way_resume(case, pristine_, run_dir / "checkpoints", way, timeout_s)
        elif way == "resume(step)":
            result, problems = way_resume(case, pristine_, step_dir, way, timeout_s)
        elif way == "guard":
            result, problems = way_guard(case, pristine_, run_dir, timeout_s)
        else:
            result, problems = way_inspect(case, run_dir / "checkpoints", timeout_s)
        if (scratch / "pwned").exists():
            problems.append(f"{way}: the planted pickle ran")
        outcomes.append(Outcome(case, way, result, problems, time.perf_counter() - t0))
    shutil.rmtree(work, ignore_errors=True)
    return outcomes


def sizes_of(pristine_: Pristine) -> dict[str, int]:
    d = pristine_.root / NEWEST_DIR
    return {f: (d / f).stat().st_size for f in LISTED}


def summarize(outcomes: list[Outcome]) -> tuple[Counter[str], Counter[tuple[str, str]], list[str]]:
    per_kind: Counter[str] = Counter()
    per_way: Counter[tuple[str, str]] = Counter()
    problems = []
    seen = set()
    for o in outcomes:
        if id(o.case) not in seen:
            seen.add(id(o.case))
            per_kind[o.case.kind] += 1
        per_way[(o.way, o.result)] += 1
        problems += [f"[{o.case.kind}: {o.case.name}] {p}" for p in o.problems]
    return per_kind, per_way, problems
