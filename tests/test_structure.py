"""Structural performance facts, asserted without a clock:

* the guard reads no device value on the host per step (no ``aten._local_scalar_dense``,
  which is what ``.item()``, ``float(t)`` and ``bool(t)`` lower to);
* the device work it adds per step is the same number of ops for a 3-tensor model and
  a 120-tensor one (fused norms, not a kernel per parameter);
* the Python calls it makes per step are the same number for both (no per-parameter
  Python function calls).

Wall-clock cost lives in benchmarks/, measured, never asserted here.
"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import Regressor, batches
from torch.utils._python_dispatch import TorchDispatchMode

import guardrails

PKG_DIR = str(Path(guardrails.__file__).parent)
STEPS = 6


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.01),
    # Fused: NanGuard hands it the skip flag on the device (optimizer.found_inf).
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
}


def run_loop(depth, guarded, tmp_path, counter=None, opt_name="sgd"):
    torch.manual_seed(0)
    model = Regressor(depth=depth)
    opt = OPTIMIZERS[opt_name](model.parameters())
    data = batches(STEPS + 2)

    def steps(it):
        for i, (x, y) in enumerate(it):
            if i == 2 and counter is not None:
                counter.__enter__()  # skip the first steps: lazy state, first allocation
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        if counter is not None:
            counter.__exit__(None, None, None)

    if guarded:
        # A ring longer than the run: the one copy per interval is not in the window.
        with guardrails.guard(
            model, opt, data, run_dir=tmp_path, metrics={"every_n_steps": 1000}, progress=False
        ) as g:
            steps(g)
    else:
        steps(data)
    return sum(1 for _ in model.parameters())


def guard_ops(depth, tmp_path, opt_name="sgd"):
    plain, guarded = OpCounter(), OpCounter()
    n_params = run_loop(depth, False, tmp_path, plain, opt_name)
    run_loop(depth, True, tmp_path / f"g{depth}", guarded, opt_name)
    extra = guarded.ops.copy()
    extra.subtract(plain.ops)
    return n_params, {k: v for k, v in extra.items() if v}


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_no_host_read_of_device_values_per_step(tmp_path, opt_name):
    _, extra = guard_ops(2, tmp_path, opt_name)
    assert "aten._local_scalar_dense" not in extra
    assert "aten.item" not in extra


def test_device_ops_per_step_do_not_grow_with_the_model(tmp_path):
    """Ops that touch data: the same for 4 parameter tensors and 122. (On CPU the grad
    norm's flat copy also makes one ``view`` a gradient: metadata, no data; pinned in
    the next test.)"""
    small_n, small = guard_ops(1, tmp_path)
    big_n, big = guard_ops(60, tmp_path)
    assert big_n >= 30 * small_n  # 4 vs 122 parameter tensors
    assert small.pop("aten.view") == small_n * STEPS
    assert big.pop("aten.view") == big_n * STEPS
    assert small == big, (small, big)
    # And it is a handful (exactly CPU_OPS_PER_STEP below): the loss's detach, the
    # gradients' flat copy and its norm.
    assert sum(small.values()) <= 3 * STEPS, small


class OutputCounter(OpCounter):
    """Also counts the tensors each op returns (``_foreach_norm`` returns one per
    gradient: one dispatch, per-tensor outputs)."""

    def __init__(self):
        super().__init__()
        self.outputs: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        n = len(out) if isinstance(out, (list, tuple)) else 1
        self.outputs[str(func.overloadpacket)] += n
        return out


#: The torch ops the default guard dispatches per step on a CPU device, beyond the
#: plain loop's: the loss picked up from the model's output (detach), and the grad norm
#: (the gradients copied into one flat tensor, its norm). The step's row (loss, grad
#: norm, skipped) that NanGuard judges and telemetry records is written from host
#: memory with no op; NanGuard's finiteness kernel and a skip's found_inf run only on a
#: bad step. Was 6 (one torch.stack per component), then 4 (the norm per tensor by
#: ``_foreach_norm``, a stack of those, their norm).
CPU_OPS_PER_STEP = {
    "aten.detach": 1,
    "aten.cat": 1,
    "aten.linalg_vector_norm": 1,
}


@pytest.mark.slow(reason="counts the ops of guarded steps for two models: ~2 CPU-s")
def test_cpu_guard_ops_per_step_are_pinned_and_o1_in_the_parameter_tensors(tmp_path):
    """Exactly CPU_OPS_PER_STEP per step for a model of 10 parameter tensors and one of
    200, plus one ``view`` a gradient inside the flat copy (torch's C++
    ``flatten_dense_tensors``: metadata, no data, a fraction of the full
    ``linalg_vector_norm`` dispatch a gradient that ``_foreach_norm`` made on CPU)."""
    per_model = {}
    for depth in (4, 99):  # 2 * (depth + 1) parameter tensors
        plain, guarded = OutputCounter(), OutputCounter()
        n_params = run_loop(depth, False, tmp_path, plain)
        run_loop(depth, True, tmp_path / f"pin{depth}", guarded)
        extra = guarded.ops.copy()
        extra.subtract(plain.ops)
        per_step = {k: v / STEPS for k, v in extra.items() if v}
        assert per_step.pop("aten.view") == n_params
        per_model[n_params] = per_step
    assert sorted(per_model) == [10, 200]
    assert per_model[10] == CPU_OPS_PER_STEP, per_model[10]
    assert per_model[200] == CPU_OPS_PER_STEP, per_model[200]


def python_calls_per_step(depth, tmp_path):
    """Python function calls made from guardrails code (and into it) over STEPS steps."""
    torch.manual_seed(0)
    model = Regressor(depth=depth)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    calls: Counter[str] = Counter()

    def ours(frame):
        return frame is not None and frame.f_code.co_filename.startswith(PKG_DIR)

    def prof(frame, event, arg):
        # Python functions in guardrails or called by it, and C functions it calls.
        if event == "call" and (ours(frame) or ours(frame.f_back)):
            calls[frame.f_code.co_name] += 1
        elif event == "c_call" and ours(frame):
            calls[f"c:{getattr(arg, '__name__', '?')}"] += 1

    with guardrails.guard(
        model,
        opt,
        batches(STEPS + 2),
        run_dir=tmp_path / f"p{depth}",
        metrics={"every_n_steps": 1000},
    ) as g:
        for i, (x, y) in enumerate(g):
            if i == 2:
                sys.setprofile(prof)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        sys.setprofile(None)
    return calls


#: Python functions the guard runs per step on a CPU loop with every default component
#: (``python_calls_per_step``'s loop, STEPS steps; C calls not counted): the step and
#: forward wrappers, the batch generator, the engine's before/after step, the grad
#: norm and the row, each component's hook. It was 32.5 before the grad norm's
#: ``.grad`` gather, the refill check, the LR read, the boundary at a fetch,
#: ``grad_norm()`` in ``step_row()`` and ``find_loss`` for a bare loss went inline
#: (callgrind: benchmarks/RESULTS.md). A change that adds a frame per step fails here:
#: measure it, then move the pin. 155 -> 167: ``Tensor.backward``'s wrapper (the loss of
#: a loop that computes it outside the model), whose call into torch's own ``backward``
#: now counts too (called from guardrails code): one real frame a step, ~0.5 us.
#: 167 -> 191: ``torch._dynamo.disable``'s wrapper (``_fn``) around the forward's and
#: the step's bookkeeping, 4 a step (~0.25 us each on a CPU), which keeps the guard out
#: of a compiled model's graph, and the step's ``prepare`` (the part before the
#: update, now a function of its own for that), less the grad norm's gather
#: comprehension (C calls now: ``map`` / ``filter``).
#: 191 -> 197: the pace guard's ``after_step`` (the step's phases appended for its
#: window medians), ~0.4 us a step on the 2-core VM; the engine's three clock reads
#: for the phases are inline (~0.25 us). 197 -> 209: the efficiency component's
#: on_boundary and after_step, each one comparison of the step counter with its next
#: sampled step (50 ns and 77 ns a call, timeit on the loaded 2-core VM).
PY_FRAMES = 209  # over STEPS (6) steps: 34.8 a step


def test_python_frames_per_step_are_pinned(tmp_path):
    calls = python_calls_per_step(1, tmp_path)
    frames = Counter({k: v for k, v in calls.items() if not k.startswith("c:")})
    assert sum(frames.values()) == PY_FRAMES, sorted(frames.items(), key=lambda kv: -kv[1])
    # No comprehension per step: the grad norm's gather is C calls over the list.
    assert frames["<listcomp>"] == 0, frames
    assert frames["_fn"] == 4 * STEPS, frames  # the bookkeeping kept out of compile


def test_python_calls_per_step_do_not_grow_with_the_model(tmp_path):
    small = python_calls_per_step(1, tmp_path)
    big = python_calls_per_step(60, tmp_path)
    assert small == big, (small, big)
    assert small["_after_step"] == STEPS and small["_before_step"] == STEPS
    assert small["_forward_done"] == STEPS


def bytecode_per_step(depth, tmp_path):
    """Python bytecode instructions run in guardrails' own frames over STEPS steps (a
    loop over the parameters in guardrails code runs some per tensor; a C call over the
    list, ``map`` or a foreach op, runs none)."""
    torch.manual_seed(0)
    model = Regressor(depth=depth)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ops: Counter[tuple[str, int]] = Counter()

    def local(frame, event, arg):
        if event == "opcode":
            ops[frame.f_code.co_name, frame.f_lineno] += 1
        return local

    def trace(frame, event, arg):
        if not frame.f_code.co_filename.startswith(PKG_DIR):
            return None
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return local

    with guardrails.guard(
        model,
        opt,
        batches(STEPS + 2),
        run_dir=tmp_path / f"b{depth}",
        metrics={"every_n_steps": 1000},
        progress=False,
    ) as g:
        for i, (x, y) in enumerate(g):
            if i == 2:
                sys.settrace(trace)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            if i == 4:  # 3 steps, boundaries included
                sys.settrace(None)
    return sum(1 for _ in model.parameters()), ops


@pytest.mark.slow(reason="traces every bytecode of guarded steps for two models: ~5 CPU-s")
def test_python_bytecode_per_step_does_not_grow_with_the_parameter_tensors(tmp_path):
    """The guard's Python work per step is the same for 150 parameter tensors and
    1,500: its per-tensor work (the grad norm's gather of the gradients) is C calls
    over the list. A comprehension over the parameters ran ~10 instructions a tensor:
    13,500 more a step at 1,500 tensors."""
    small_n, small = bytecode_per_step(74, tmp_path)
    big_n, big = bytecode_per_step(749, tmp_path)
    assert (small_n, big_n) == (150, 1500)
    grew = {k: (small[k], big[k]) for k in small.keys() | big.keys() if small[k] != big[k]}
    assert not grew, grew
    assert sum(small.values()) < 2_000 * 3  # ~1,000 a step: a few hooks' worth


# ---------------------------------------------------------------------- the contract
# ARCHITECTURE.md's rules that can be read off the code: who writes the guard's state,
# and what each component declares.

_PKG = Path(guardrails.__file__).parent


def _assignments(tree: ast.AST):
    """Every attribute assignment target in ``tree``: (node, dotted target)."""
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(el, ast.Attribute):
                    yield el, ast.unparse(el)


def test_only_the_engine_writes_the_guard_and_each_shared_field_has_one_writer():
    from guardrails.engine.state import ENGINE_MODULES, SHARED_WRITERS

    offences = []
    for path in sorted(_PKG.rglob("*.py")):
        module = ".".join(path.relative_to(_PKG).with_suffix("").parts)
        tree = ast.parse(path.read_text())
        for node, target in _assignments(tree):
            parts = target.split(".")
            if parts[-1].startswith("__"):  # guard.__doc__ in _factory: the function's
                continue
            if "shared" in parts[:-1]:  # guard.shared.<field> = ...
                field = parts[-1]
                if SHARED_WRITERS.get(field) != module:
                    offences.append(f"{module}:{node.lineno} writes shared {field}")
            elif module not in ENGINE_MODULES and (
                parts[0] == "guard" or target.startswith("self._guard.")
            ):
                offences.append(f"{module}:{node.lineno} writes {target}")
    assert offences == [], "components ask the engine through services:\n" + "\n".join(offences)
    from guardrails.engine.state import Shared

    # Every declared shared field has a writer, and every writer a declared field.
    assert set(SHARED_WRITERS) == {f.name for f in dataclasses.fields(Shared)}


def test_every_default_component_declares_the_protocol():
    from guardrails._factory import SECTIONS

    names = set()
    for cls in SECTIONS.values():
        assert "name" in vars(cls) and cls.name not in names, cls
        names.add(cls.name)
        assert dataclasses.is_dataclass(cls.Config), cls
        doc = cls.Config.__doc__ or ""
        for field in dataclasses.fields(cls.Config):  # each knob documented, once, there
            assert f"{field.name}:" in doc, f"{cls.__name__}.Config.{field.name} undocumented"
        for other in (*cls.after, *cls.before):  # constraints name real components
            assert other in {c.name for c in SECTIONS.values()}, (cls, other)
    # The defaults, in SECTIONS order, satisfy every constraint they declare.
    from guardrails.engine.component import check_components

    check_components([cls() for cls in SECTIONS.values()])


@pytest.mark.slow(reason="a fresh interpreter importing torch and guardrails: ~3.5 CPU-s")
def test_a_guard_start_imports_no_heavy_torch_package_it_does_not_need(tmp_path):
    """Checks for sharded models and ZeroRedundancyOptimizer look their classes up in
    ``sys.modules`` instead of importing them: ``torch.distributed.optim`` compiles its
    functional optimizers with TorchScript on import (0.3-1.0 s of CPU at every start
    on the 2-core VM), and an object can only be an instance of a class whose module
    was imported. A fresh process, so nothing else imported them first."""
    code = (
        "import sys, torch, guardrails\n"
        "m = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "data = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(3)]\n"
        f"with guardrails.guard(m, opt, data, run_dir={str(tmp_path)!r}, progress=False) as g:\n"
        "    for x, y in g:\n"
        "        ((m(x) - y) ** 2).mean().backward(); opt.step(); opt.zero_grad()\n"
        "    g.save_checkpoint()\n"
        "print(sorted(k for k in sys.modules if k.startswith('torch.distributed.optim')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


def test_each_service_in_shared_is_provided_as_its_protocol_says():
    """A Shared slot typed with a protocol of engine/services.py: the component that
    writes it (SHARED_WRITERS) is an instance of that protocol, and each method has the
    protocol's signature (names, kinds, defaults), so a caller that reads the protocol
    calls the provider correctly; ``tests/test_layout.py`` holds the callers to it."""
    import importlib
    import inspect
    import typing

    from guardrails.engine import services
    from guardrails.engine.component import Component
    from guardrails.engine.state import SHARED_WRITERS, Shared

    protocols = {
        c
        for _, c in inspect.getmembers(services, inspect.isclass)
        if getattr(c, "_is_protocol", False)
    }
    hints = typing.get_type_hints(Shared)
    provided = {}
    for slot, writer in SHARED_WRITERS.items():
        typed = [p for p in typing.get_args(hints[slot]) if p in protocols]
        if not typed:
            continue
        (protocol,) = typed
        module = importlib.import_module(f"guardrails.{writer}")
        (cls,) = [
            c
            for c in vars(module).values()
            if isinstance(c, type) and issubclass(c, Component) and c.__module__ == module.__name__
        ]
        provider = cls()
        assert isinstance(provider, protocol), (cls, protocol)
        for name, member in vars(protocol).items():
            if inspect.isfunction(member) and not name.startswith("_"):
                mine = inspect.signature(getattr(cls, name), eval_str=True)
                assert mine == inspect.signature(member, eval_str=True), (cls, name, mine)
        provided[slot] = (cls.__name__, protocol.__name__)
    assert provided == {
        "auditor": ("CollectiveAuditor", "CollectiveRecorder"),
        "rewind": ("Rewind", "RewindService"),
    }


def _marks(decorators: list[ast.expr]) -> dict[str, ast.expr]:
    """``@pytest.mark.NAME`` or ``@pytest.mark.NAME(...)`` decorators, by NAME."""
    found = {}
    for deco in decorators:
        node = deco.func if isinstance(deco, ast.Call) else deco
        if isinstance(node, ast.Attribute) and ast.unparse(node.value).endswith("mark"):
            found[node.attr] = deco
    return found


def _says_why(mark: ast.expr) -> bool:
    reason = next((k.value for k in getattr(mark, "keywords", []) if k.arg == "reason"), None)
    return isinstance(reason, ast.Constant) and bool(str(reason.value).strip())


def test_every_slow_marker_says_why_and_real_torchrun_tests_are_slow():
    # The quick tier (-m "not slow", docs/development.md) stays under 2 minutes because
    # every test over ~2 s carries the marker, with the reason it takes long; a test
    # that starts a real torchrun (a launcher and its ranks, each a fresh interpreter
    # importing torch: 10 CPU-s and more) can never be quick.
    unsaid, unmarked = [], []
    for path in sorted(Path(__file__).parent.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_slow = None
        for node in tree.body:
            if isinstance(node, ast.Assign) and "pytestmark" in ast.unparse(node.targets[0]):
                values = node.value.elts if isinstance(node.value, ast.List) else [node.value]
                module_slow = _marks(values).get("slow", module_slow)
        if module_slow is not None and not _says_why(module_slow):
            unsaid.append(f"{path.name}: pytestmark")
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
                continue
            slow = _marks(node.decorator_list).get("slow")
            if slow is not None and not _says_why(slow):
                unsaid.append(f"{path.name}::{node.name}")
            calls = {c.func.id for c in ast.walk(node) if isinstance(c, ast.Call)
                     and isinstance(c.func, ast.Name)}  # fmt: skip
            if calls & {"torchrun", "launch_torchrun"} and slow is None and module_slow is None:
                unmarked.append(f"{path.name}::{node.name}")
    assert not unsaid, f'@pytest.mark.slow without reason="...": {unsaid}'
    assert not unmarked, f"real torchrun jobs outside the slow tier: {unmarked}"
