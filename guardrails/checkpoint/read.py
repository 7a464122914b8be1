"""The read side's checks: a checkpoint's files read and each part held against the live
object it will load into (keys, shapes, classes, values) before anything is applied.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from torch import Tensor, nn

from guardrails._errors import CheckpointError, GuardrailsError, ResumeError
from guardrails.checkpoint import sharded as _sharded
from guardrails.checkpoint.codec import decode
from guardrails.checkpoint.common import (
    _manifest_error,
    _natural,
    _read_tensors,
    _short,
    log,
)

# The manifest and the checks of a checkpoint's files, torch-free (`inspect` uses them).
from guardrails.checkpoint.files import not_regular, read_json
from guardrails.checkpoint.manifest import (
    ASIDE_RE,
    MANIFEST,
    STEP_RE,
    ManifestError,
    list_checkpoints,
)
from guardrails.checkpoint.manifest import problem as _manifest_problem
from guardrails.checkpoint.schema import Bad
from guardrails.checkpoint.schema import check_rng as _manifest_check_rng
from guardrails.checkpoint.stage import (
    _ELEMENTWISE_STATE,
    per_rank,
)
from guardrails.util.text import shorten


class _Reader:
    """Reads a checkpoint's listed files, and only those, turning whatever a damaged
    file raises (``SafetensorError``, ``JSONDecodeError``, ``KeyError``...) into a
    ``CheckpointError`` naming the file and the field."""

    def __init__(self, ckpt: Path, step: int, files: Mapping[str, Any]) -> None:
        self.ckpt, self.step, self.files = ckpt, step, files

    def path(self, name: str) -> Path:
        if name not in self.files:
            raise self.bad(name, "", f"is not among the files {MANIFEST} lists, so it is not read")
        return self.ckpt / name

    def json(self, name: str) -> Any:
        with self.reading(name):
            return read_json(self.path(name))

    def tensors(self, name: str) -> dict[str, Tensor]:
        with self.reading(name):
            return _read_tensors(self.path(name))

    @contextlib.contextmanager
    def reading(self, name: str, field: str = "") -> Iterator[None]:
        try:
            yield
        except GuardrailsError:
            raise
        except Bad as e:
            raise self.bad(name, e.field, e.why) from None
        except _DAMAGE as e:
            raise self.bad(name, field, f"cannot be decoded ({type(e).__name__}: {e})") from None

    def bad(self, name: str, field: str, why: str) -> CheckpointError:
        f = self.ckpt / name
        what = f"field {field} " if field else ""
        return CheckpointError(
            f"checkpoint {self.ckpt} is not valid: {f} is corrupt: {what}{why}",
            step=self.step,
            path=str(f),
            field=field or None,
        )

    def same_keys(
        self, name: str, saved: Any, obj: Any, what: str, *, same_torch: bool = True
    ) -> None:
        """``saved`` (a state_dict of one of torch's own classes, read from ``name``) has
        the keys of ``live`` (this run's object's state_dict): none missing, none
        extra. ``load_state_dict`` copies every key it is given into the object (an
        extra ``optimizer`` replaced the scheduler's optimizer; the first
        ``sched.step()`` crashed) and keeps its own value for a missing one (a
        scheduler state ``{}`` "resumed" and kept counting from zero). Keys starting
        with ``_`` are torch's bookkeeping, added and removed between versions, and so
        is any key when the checkpoint was saved by another torch version
        (``same_torch=False``): then only an empty state, or a key that would replace
        something the object holds outside its state, is refused."""
        live = obj.state_dict()
        if not isinstance(saved, Mapping):
            raise self.bad(name, "", f"is {_show(saved)}, where {what}'s state is an object")
        public = [k for k in live if not str(k).startswith("_")]
        missing = [k for k in public if k not in saved]
        if missing and (same_torch or len(missing) == len(public)):
            k = missing[0]
            raise self.bad(
                name,
                str(k),
                f"is missing ({len(missing)} key(s) missing: {_short(missing)}): {what}'s "
                f"state holds {k!r} ({_show(live[k])} in this run)",
            )
        extra = [k for k in saved if k not in live]
        for k in extra:
            shadows = isinstance(k, str) and hasattr(obj, k)  # `optimizer`, `lr_lambdas`
            if shadows or (same_torch and not str(k).startswith("_")):
                raise self.bad(
                    name,
                    str(k),
                    f"is {_show(saved[k])}, a key {what}'s state does not have (its keys: "
                    f"{_short(list(live))})",
                )

    def like(self, name: str, saved: Any, live: Any) -> None:
        """``saved`` (a state_dict read from ``name``) has the types of ``live`` (the
        live object's own state_dict, of the same class): a number where it holds a
        number, a list as long as its list. Strings, booleans and ``None`` on the live
        side are not compared (their defaults change between torch versions)."""
        problem = _unlike(saved, live, "")
        if problem is not None:
            raise self.bad(name, *problem)


#: What reading a damaged file can raise, besides guardrails' own errors.
_DAMAGE = (
    OSError,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    OverflowError,
    RecursionError,
    AttributeError,
    SafetensorError,
    RuntimeError,
    pickle.UnpicklingError,
    EOFError,
)


def _torch_own(obj: Any, module: str) -> bool:
    """Whether ``obj`` is of one of torch's own classes, whose state keeps its shape
    (a list of one lr per group); a user's scheduler may keep a history that grows, so
    its fresh state is no template for a saved one."""
    return type(obj).__module__.startswith(module)


def _unlike(saved: Any, live: Any, field: str) -> tuple[str, str] | None:
    """``(field, why)`` where ``saved`` does not have ``live``'s types, or ``None``."""
    if isinstance(live, bool) or live is None or isinstance(live, str):
        return None
    if isinstance(live, (int, float)):
        # Not int against float: a scheduler decays an lr given as 1 to 0.5; the fields
        # that must be integers are checked with the file (manifest.py's schemas).
        if isinstance(saved, bool) or not isinstance(saved, (int, float, Tensor)):
            return field, f"is {_show(saved)}, where this run's holds a number ({live!r})"
        return None
    if isinstance(live, Tensor):
        if not isinstance(saved, (Tensor, int, float)) or isinstance(saved, bool):
            return field, f"is {_show(saved)}, where this run's holds a tensor"
        return None
    if isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)):
            return field, f"is {_show(saved)}, where this run's holds a list of {len(live)}"
        if len(saved) != len(live):
            return field, f"has {len(saved)} items, where this run's has {len(live)}"
        for i, (s, v) in enumerate(zip(saved, live, strict=True)):
            found = _unlike(s, v, f"{field}[{i}]")
            if found is not None:
                return found
        return None
    if isinstance(live, Mapping):
        if not isinstance(saved, Mapping):
            return field, f"is {_show(saved)}, where this run's holds an object"
        for key in saved:
            if key in live:
                found = _unlike(saved[key], live[key], f"{field}.{key}" if field else str(key))
                if found is not None:
                    return found
    return None


def _kind(dtype: torch.dtype) -> str:
    """A dtype's kind: a float of another width loads as the model's dtype (a run moved
    to bf16); a float saved as an int does not fit."""
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "int"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:30] + "..."


def _check_optimizer_values(
    reader: _Reader,
    name: str,
    optimizer: Any,
    saved: Mapping[str, Any],
    added: list[dict[str, Any]] | None = None,
) -> None:
    """The saved param groups' settings have the types of the live optimizer's (a
    string ``lr`` loads, then the first step dies); ``added``: the groups the resume
    will add to it (:func:`_added_groups`)."""
    groups = [*per_rank(optimizer).param_groups, *(added or [])]
    for i, (g, s) in enumerate(zip(groups, saved["param_groups"], strict=True)):
        if not isinstance(s, Mapping):
            raise reader.bad(name, f"param_groups[{i}]", f"is {_show(s)}, not an object")
        # Numbers and tuples only (lr, betas): settings, fixed in shape; a user's
        # optimizer may keep a list in its group that grows.
        live = {
            k: v
            for k, v in g.items()
            if k not in ("params", "param_names") and not isinstance(v, (list, Mapping))
        }
        problem = _unlike({k: v for k, v in s.items() if k in live}, live, f"param_groups[{i}]")
        if problem is not None:
            raise reader.bad(name, *problem)


def _check_group_keys(
    reader: _Reader, name: str, optimizer: Any, saved: Mapping[str, Any], count: int
) -> None:
    """Every setting of the optimizer's own (its ``defaults``: ``lr``, ``betas``...)
    that this run's param groups hold is in the saved groups, or is one it fills in
    itself when it loads an older state (``foreach``, ``differentiable``...: its
    ``__setstate__``, replayed on a scratch copy). A group without ``betas`` loaded,
    and the first ``opt.step()`` died with a ``KeyError``. ``count``: how many of the
    saved groups belong to the live ones."""
    opt = per_rank(optimizer)
    groups = saved["param_groups"]
    filled = _filled_groups(opt, groups)
    for i, (g, s) in enumerate(zip(opt.param_groups, groups[:count], strict=False)):
        if not isinstance(s, Mapping):
            continue  # said by _check_optimizer_values
        have = filled[i] if filled is not None else s
        # The optimizer's own settings (its defaults) only: a key another object put in
        # the group (a scheduler's `initial_lr`) is not the step's, and a checkpoint
        # saved before that object existed lacks it rightly.
        missing = [k for k in g if k in opt.defaults and k not in have]
        if missing:
            k = missing[0]
            raise reader.bad(
                name,
                f"param_groups[{i}].{k}",
                f"is missing ({_short(missing)}): {type(opt).__name__}'s param groups hold "
                f"{k!r} ({_show(g[k])} in this run), and its step() reads it",
            )


def _filled_groups(opt: Any, groups: list[Any]) -> list[Mapping[str, Any]] | None:
    """The saved groups as the optimizer's own ``__setstate__`` completes them (the
    defaults it adds for settings older versions did not have), on a scratch object
    with no parameters; ``None`` when that cannot be replayed (a custom optimizer's
    ``__setstate__`` that needs more)."""
    try:
        scratch = object.__new__(type(opt))
        scratch.__setstate__(
            {
                "defaults": dict(opt.defaults),
                "state": {},
                "param_groups": [
                    {**g, "params": []} if isinstance(g, Mapping) else g for g in groups
                ],
            }
        )
        return list(scratch.param_groups)
    except Exception:
        return None


def _check_optimizer_state(
    reader: _Reader, name: str, optimizer: Any, saved: Mapping[str, Any]
) -> None:
    """Each saved per-parameter state entry holds a tensor where one belongs: where
    this run's optimizer holds a tensor under that key, or where the other entries of
    the saved state do. A number where ``exp_avg`` belongs loaded, and the first
    ``opt.step()`` died in ``lerp_``."""
    live: dict[str, Any] = {}
    for st in per_rank(optimizer).state.values():
        for k, v in st.items():
            live.setdefault(k, v)
    tensor_keys = {k for k, v in live.items() if isinstance(v, Tensor)}
    for st in saved["state"].values():
        if isinstance(st, Mapping):
            tensor_keys |= {k for k, v in st.items() if isinstance(v, Tensor) and k != "step"}
    for idx, st in saved["state"].items():
        if not isinstance(st, Mapping):
            raise reader.bad(name, f"state.{idx}", f"is {_show(st)}, not an object")
        for k, v in st.items():
            was = live.get(k)
            # Issue 52: an F32 state saved as I32 (the manifest re-hashed) loaded.
            if (
                isinstance(v, Tensor)
                and isinstance(was, Tensor)
                and k != "step"
                and _kind(v.dtype) != _kind(was.dtype)
            ):
                raise reader.bad(
                    name,
                    f"state.{idx}.{k}",
                    f"is a {v.dtype} tensor, where this run's "
                    f"{type(per_rank(optimizer)).__name__} keeps {k!r} as {was.dtype}",
                )
            # `step` is a number in older torch and in capturable=False loads: fine.
            if k in tensor_keys and k != "step" and not isinstance(v, Tensor) and v is not None:
                raise reader.bad(
                    name,
                    f"state.{idx}.{k}",
                    f"is {_show(v)}, where a tensor belongs ({type(per_rank(optimizer)).__name__}"
                    f" keeps {k!r} as a tensor per parameter)",
                )


def _check_rng(
    reader: _Reader,
    name: str,
    tensors_name: str,
    states: Mapping[str, Any] | None,
    tensors: Mapping[str, Tensor],
) -> None:
    """The RNG streams load: each one set into a scratch generator of its kind (their
    own checks, exact), so none can fail while being restored."""
    if states is not None:
        with reader.reading(name, "rng"):
            _manifest_check_rng(states, "rng")
            kind, keys, pos, has_gauss, cached = states["numpy"]
            np.random.RandomState().set_state(
                (kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)
            )
    for key, t in tensors.items():
        if key == "torch.cpu" or key.startswith("torch.cuda."):
            with reader.reading(tensors_name, key):
                if t.dtype != torch.uint8 or t.dim() != 1:
                    raise ValueError(
                        f"a {t.dtype} tensor of shape {tuple(t.shape)}, not a byte tensor"
                    )
                if key == "torch.cpu":
                    torch.Generator().set_state(t)


def _corrupt(ckpt: Path, bad_file: str, why: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {ckpt} is not valid: {why}",
        path=bad_file,
        hint=skip_hint(ckpt),
    )


def _check_materialized(ckpt: Path, step: int, model: nn.Module) -> None:
    """The model's tensors have storage: a model built on the meta device (``with
    torch.device("meta")``, accelerate's ``init_empty_weights``) takes no values from
    ``load_state_dict`` (it "resumed" and loaded nothing)."""
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ResumeError(
            f"the model has {len(meta)} tensor(s) on the meta device ({_short(meta, 3)}): "
            f"they hold no memory, so nothing from {ckpt} could be loaded into them",
            step=step,
            path=str(ckpt),
            hint="materialize the model first, then resume: model.to_empty(device=...) "
            "(allocates every tensor, uninitialized; the resume then fills them). "
            "Nothing was modified.",
        )


def _check_model(
    ckpt: Path, step: int, model: nn.Module, saved: Mapping[str, Tensor], strict: bool
) -> None:
    live = model.state_dict()
    # A tensor of another kind (an int where a float was: a hand-edited F32 -> I32)
    # would load converted, and training would go on from the converted values.
    kinds = [
        f"{k}: checkpoint {saved[k].dtype} vs model {v.dtype}"
        for k, v in live.items()
        if k in saved and isinstance(v, Tensor) and _kind(saved[k].dtype) != _kind(v.dtype)
    ]
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    shapes = [
        f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(v.shape)}"
        for k, v in live.items()
        if k in saved and isinstance(v, Tensor) and tuple(saved[k].shape) != tuple(v.shape)
    ]
    problems = []
    if shapes:
        problems.append(f"shape mismatch ({len(shapes)}): {_short(shapes)}")
    if kinds:
        problems.append(f"dtype mismatch ({len(kinds)}): {_short(kinds)}")
    if strict and missing:
        problems.append(f"in the model but not the checkpoint ({len(missing)}): {_short(missing)}")
    if strict and unexpected:
        problems.append(
            f"in the checkpoint but not the model ({len(unexpected)}): {_short(unexpected)}"
        )
    if problems:
        hint = (
            "build the model with the same architecture and config that was saved "
            "(width, depth, vocab size, wrappers such as DDP or torch.compile add a "
            "'module.' / '_orig_mod.' prefix)"
        )
        if kinds:
            hint += "; a tensor saved as another kind of number is not converted"
        if not shapes and not kinds:  # only keys differ: loading the matching part can work
            hint += (
                "; to load only the matching part, e.g. a backbone under a new head, pass "
                "strict=False"
            )
        raise ResumeError(
            f"checkpoint {ckpt} does not fit this model; " + "; ".join(problems),
            step=step,
            path=str(ckpt),
            hint=hint + ". The model was not modified.",
            remedy=None if shapes or kinds else "strict",
        )


def _pair(
    ckpt: Path,
    step: int,
    kind: str,
    live: Mapping[str, Any],
    contents: Mapping[str, Any],
    strict: bool,
) -> list[tuple[str, Any, Any]]:
    """``(name, live object, what the manifest says of it)`` for each live optimizer /
    scheduler: matched by name, or the lone one to the lone one."""
    saved = contents[f"{kind}s"]
    if not live:
        return []
    if not saved:
        if strict:
            raise _missing(ckpt, step, kind)
        return []
    if len(live) == 1 and len(saved) == 1:
        return [(next(iter(live)), next(iter(live.values())), next(iter(saved.values())))]
    unknown = [n for n in live if n not in saved]
    if unknown and strict:
        raise ResumeError(
            f"checkpoint {ckpt} holds no {kind} named {_short(unknown)}: it holds "
            f"{_short(list(saved))}, this run has {_short(list(live))}",
            step=step,
            path=str(ckpt),
            hint=f"pass the {kind}s under the names they were saved with (the keys of the "
            f"dict, or their positions in the list, given to guard()). Nothing was modified.",
        )
    return [(n, obj, saved[n]) for n, obj in live.items() if n in saved]


def _check_optimizer(
    ckpt: Path,
    step: int,
    name: str | None,
    optimizer: Any,
    saved: Mapping[str, Any],
    model: nn.Module,
    added: list[dict[str, Any]] | None = None,
) -> None:
    """The saved state fits ``optimizer``: the same param groups, the same number of
    parameters in each, each parameter the shape it had when saved. The state tensors
    themselves are trusted to fit (a state need not have its parameter's shape: Muon
    keeps one stacked momentum per group of parameters). ``added``: the groups the
    resume will add to it (:func:`_added_groups`)."""
    opt = per_rank(optimizer)
    which = "optimizer" if name is None else f"optimizer {name!r}"
    groups = [*opt.param_groups, *(added or [])]
    saved_groups = saved["param_groups"]
    problems = []
    if len(groups) != len(saved_groups):
        problems.append(f"{len(saved_groups)} param groups saved, {len(groups)} now")
    else:
        for i, (g, s) in enumerate(zip(groups, saved_groups, strict=True)):
            if len(g["params"]) != len(s["params"]):
                problems.append(
                    f"group {i}: {len(s['params'])} parameters saved, {len(g['params'])} now"
                )
    if not problems:
        names = {id(p): n for n, p in model.named_parameters()}
        params = [p for g in groups for p in g["params"]]
        ids = [i for s in saved_groups for i in s["params"]]
        shapes = saved.get("param_shapes")
        for pos, (idx, p) in enumerate(zip(ids, params, strict=True)):
            label = f"param {idx}" + (f" (`{names[id(p)]}`)" if id(p) in names else "")
            if shapes is not None:  # format 3: the shape each parameter was saved with
                if tuple(shapes[pos]) != tuple(p.shape):
                    problems.append(
                        f"{label}: saved for shape {tuple(shapes[pos])}, the parameter is "
                        f"{tuple(p.shape)} now"
                    )
                continue
            for key, v in saved["state"].get(idx, {}).items():  # formats 1-2
                if key in _ELEMENTWISE_STATE and isinstance(v, Tensor) and v.shape != p.shape:
                    problems.append(
                        f"{label} {key}: checkpoint {tuple(v.shape)} vs parameter {tuple(p.shape)}"
                    )
    if problems:
        raise ResumeError(
            f"checkpoint {ckpt} {which} state does not fit this {which}; " + _short(problems),
            step=step,
            path=str(ckpt),
            hint="build the optimizer over the same parameters, in the same order and "
            "param groups, as the run that saved it; to restart the optimizer from "
            "scratch, pass optimizer=None. Nothing was modified.",
            remedy="no_optimizer",
        )


def _added_groups(
    ckpt: Path,
    step: int,
    name: str | None,
    optimizer: Any,
    saved: Mapping[str, Any],
    model: nn.Module,
) -> list[tuple[dict[str, Any], list[bool]]]:
    """The param groups the run that saved ``saved`` had added to its optimizer
    (``optimizer.add_param_group``: a layer unfrozen at step N) beyond the groups this
    run's ``optimizer`` was built with, as groups to add to it (their parameters found
    in ``model`` by name, their settings as saved), each with its parameters'
    ``requires_grad`` as saved (for the resume to set: an unfrozen layer), so that
    the same command resumes: its optimizer is built before any checkpoint is read.
    ``[]`` when there are none; a ``ResumeError`` saying what to do when they cannot be
    re-created. Nothing is modified."""
    opt = per_rank(optimizer)
    live, groups = opt.param_groups, saved["param_groups"]
    if len(groups) <= len(live) or any(
        len(g["params"]) != len(s["params"]) for g, s in zip(live, groups, strict=False)
    ):
        return []  # not groups added at the end: _check_optimizer names the mismatch
    which = "the optimizer" if name is None else f"optimizer {name!r}"
    by_name = dict(model.named_parameters())
    taken = {id(p) for g in live for p in g["params"]}
    recorded = saved.get("group_params")
    added: list[tuple[dict[str, Any], list[bool]]] = []
    for i in range(len(live), len(groups)):
        entries = recorded[i] if isinstance(recorded, list) and i < len(recorded) else None
        names = [e.get("name") for e in entries] if entries is not None else []
        why = None
        if entries is None or len(entries) != len(groups[i]["params"]):
            why = "the checkpoint does not record its parameters' names (saved before they were)"
        elif None in names:
            why = "parameters outside the model are in it (a resume finds them by name)"
        elif missing := [n for n in names if n not in by_name]:
            why = f"the model has no parameter named {shorten([str(n) for n in missing], 3)}"
        elif clash := [n for n in names if id(by_name[n]) in taken]:
            why = f"{shorten(clash, 3)} already in another of its param groups"
        if why is not None:
            shown = [str(n) if n is not None else "a parameter outside the model" for n in names]
            shown = shorten(shown, 4) if names else "its parameters"
            raise ResumeError(
                f"checkpoint {ckpt}: {which} had {len(groups)} param groups when it was "
                f"saved, {len(live)} here; group {i} ({shown}) was added during that run "
                f"(optimizer.add_param_group), and cannot be re-created here: {why}",
                step=step,
                path=str(ckpt),
                hint=f"add group {i} to the optimizer yourself before the resume, over the "
                "same parameters in the same order (optimizer.add_param_group({'params': "
                "[...]}); its settings, lr and the rest, are restored from the checkpoint), "
                "when a checkpoint is there to resume. Nothing was modified.",
            )
        assert entries is not None
        params = [by_name[n] for n in names]
        taken.update(id(p) for p in params)
        settings = {k: v for k, v in groups[i].items() if k != "params"}
        trains = [e.get("requires_grad") is not False for e in entries]
        added.append(({"params": params, **settings}, trains))
    return added


def _saved_trains(optimizer: Any, saved: Mapping[str, Any]) -> list[tuple[Tensor, bool]]:
    """Each parameter of this run's param groups with its ``requires_grad`` as saved
    (recorded by group, in the groups' order), where that differs from now: a layer
    unfrozen (``requires_grad_(True)``) or frozen inside a group during the saved run,
    which the same command would otherwise resume frozen (or training). Read after
    :func:`_check_optimizer` (the same groups, the same number of parameters in each);
    ``[]`` for a checkpoint that does not record it. Nothing is modified."""
    recorded = saved.get("group_params")
    if not isinstance(recorded, list):
        return []
    out: list[tuple[Tensor, bool]] = []
    for group, entries in zip(per_rank(optimizer).param_groups, recorded, strict=False):
        if not isinstance(entries, list):
            continue
        for p, entry in zip(group["params"], entries, strict=False):
            wants = entry.get("requires_grad") if isinstance(entry, Mapping) else None
            if isinstance(wants, bool) and wants != p.requires_grad:
                out.append((p, wants))
    return out


def _check_classes(
    ckpt: Path,
    step: int,
    contents: Mapping[str, Any],
    optimizers: Mapping[str, Any],
    schedulers: Mapping[str, Any],
) -> None:
    """Each optimizer and scheduler is of the class whose state was saved (checkpoints
    that record classes: written by guardrails 0.2 since this check)."""
    saved = contents.get("classes") or {}
    wrong = []
    for kind, objs in (("optimizer", optimizers), ("scheduler", schedulers)):
        for name, obj in objs.items():
            was = saved.get(f"{kind}:{name}")
            now = type(per_rank(obj) if kind == "optimizer" else obj).__name__
            if was is not None and was != now:
                who = kind if len(objs) == 1 else f"{kind} {name!r}"
                wrong.append(f"the {who} was saved from {was}, this run's is {now}")
    if wrong:
        raise ResumeError(
            f"checkpoint {ckpt} does not fit this run: " + "; ".join(wrong) + " (another "
            "class's state would load half-way and fail later)",
            step=step,
            path=str(ckpt),
            hint="resume with the classes that saved it, or start this configuration as a "
            "new run (a new run_dir, or guard(..., resume=None)). Nothing was modified.",
        )


def _component_state(reader: _Reader, name: str, strict: bool) -> Any:
    """The saved state_dict of an optional component (``scheduler``, ``scaler``): its
    ``<name>.json``, or ``<name>.pt`` when it was not JSON-able; ``None`` if absent and
    not ``strict``."""
    if f"{name}.json" in reader.files:
        return decode(reader.json(f"{name}.json"))
    if f"{name}.pt" in reader.files:
        with reader.reading(f"{name}.pt"):
            path = reader.path(f"{name}.pt")
            why = not_regular(path)
            if why is not None:
                raise OSError(why)
            return torch.load(path, weights_only=True)
    if strict:
        raise _missing(reader.ckpt, reader.step, name)
    return None


def _missing(ckpt: Path, step: int, what: str) -> ResumeError:
    if what == "model":
        return ResumeError(
            f"checkpoint {ckpt} holds no model state: its {MANIFEST} lists no "
            "model.safetensors (field files), and files it does not list are never read",
            step=step,
            path=str(ckpt / MANIFEST),
            field="files",
            hint="resume from an older step_* directory; or pass strict=False to leave "
            "the model as it is and restore the rest. Nothing was modified.",
            remedy="no_model",
        )
    return ResumeError(
        f"checkpoint {ckpt} holds no {what} state, but a {what} was passed to resume()",
        step=step,
        path=str(ckpt),
        hint=f"pass {what}=None to keep this {what} as it is, or strict=False to skip "
        "what the checkpoint lacks. Nothing was modified.",
        remedy=f"no_{what}",
    )


def _load_optimizer(reader: _Reader, stem: str = "optimizer") -> dict[str, Any]:
    tensors = {}
    if f"{stem}.safetensors" in reader.files:
        tensors = reader.tensors(f"{stem}.safetensors")
    raw = reader.json(f"{stem}.json")
    with reader.reading(f"{stem}.json", "state"):
        if not isinstance(raw, dict) or not isinstance(raw.get("state"), dict):
            raise ValueError("the state is not an object")
        state = {int(k): decode(v, tensors) for k, v in raw["state"].items()}
    with reader.reading(f"{stem}.json", "param_groups"):
        out = {"state": state, "param_groups": decode(raw["param_groups"], tensors)}
        if not isinstance(out["param_groups"], list):
            raise ValueError("param_groups is not a list")
    for key in ("param_shapes", "group_params"):
        if key in raw:
            out[key] = raw[key]
    return out


def _restore_rng(states: Mapping[str, Any] | None, tensors: Mapping[str, Tensor]) -> None:
    if states is not None:
        version, internal, gauss = states["python"]
        random.setstate((version, tuple(internal), gauss))
        kind, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "torch.cpu" in tensors:
        torch.set_rng_state(tensors["torch.cpu"])
    cuda = [tensors[k] for k in sorted(tensors, key=_natural) if k.startswith("torch.cuda.")]
    if cuda:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n != len(cuda):
            log.warning(
                "guardrails: the checkpoint holds CUDA RNG states for %d devices, this "
                "process sees %d; restoring the first %d (dropout on the others differs)",
                len(cuda),
                n,
                min(n, len(cuda)),
            )
        for i, s in enumerate(cuda[:n]):
            torch.cuda.set_rng_state(s, i)


def skip_hint(ckpt: Path) -> str:
    """What to do about an invalid checkpoint: the previous valid one next to it, if
    any (each older one verified, newest first), else a backup."""
    previous = None
    m = STEP_RE.match(ckpt.name) or ASIDE_RE.match(ckpt.name)  # a re-save's aside copy too
    step = int(m.group(m.lastindex or 1)) if m else -1
    for s, p in reversed(list_checkpoints(ckpt.parent)):
        try:
            if s < step and verify_checkpoint(p) is None:
                previous = p
                break
        except GuardrailsError:  # an older one in a newer format: not a candidate
            continue
    if previous is not None:
        return (
            f"resume from the previous valid checkpoint instead ({previous}), or delete "
            f"or move away {ckpt}: a resume from the run's checkpoint directory then "
            "uses the previous one (it skips invalid ones by itself); or start fresh "
            "with resume=None."
        )
    return (
        f"no earlier valid checkpoint exists next to it: restore {ckpt} from a backup, "
        "or start fresh with resume=None (or delete or move it away)."
    )


def verify_checkpoint(ckpt: str | os.PathLike[str]) -> str | None:
    """``None`` when ``ckpt`` is a valid checkpoint, else why not (one line, naming the
    file and the field). Reads every byte once (sha256) and checks every listed file's
    content against what guardrails writes there."""
    problem = _problem(Path(ckpt))
    return None if problem is None else problem[1]


def _problem(ckpt: Path, *, entry: bool = False) -> tuple[str, str] | None:
    """``(file, why)`` for the first problem found in ``ckpt``, or ``None``. ``entry``:
    found under a root, so it must not be a link."""
    try:
        return _manifest_problem(ckpt, entry=entry, metadata_check=_sharded.metadata_problem)
    except ManifestError as e:  # a newer format: intact, but not ours to read
        raise _manifest_error(e) from None
