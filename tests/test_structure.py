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
    small_n, small = guard_ops(1, tmp_path)
    big_n, big = guard_ops(60, tmp_path)
    assert big_n >= 30 * small_n  # 4 vs 122 parameter tensors
    assert small == big, (small, big)
    # And it is a handful: fused norm, stack, norm of norms, one write into each ring
    # (telemetry, NanGuard), NanGuard's finiteness check.
    assert sum(small.values()) <= 8 * STEPS, small


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


def test_python_calls_per_step_do_not_grow_with_the_model(tmp_path):
    small = python_calls_per_step(1, tmp_path)
    big = python_calls_per_step(60, tmp_path)
    assert small == big, (small, big)
    assert small["_after_step"] == STEPS and small["_before_step"] == STEPS
    assert small["_pick_loss"] == STEPS


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
    from guardrails._state import ENGINE_MODULES, SHARED_WRITERS

    offences = []
    for path in sorted(_PKG.glob("_*.py")):
        module = path.stem
        tree = ast.parse(path.read_text())
        for node, target in _assignments(tree):
            parts = target.split(".")
            if "shared" in parts[:-1]:  # guard.shared.<field> = ...
                field = parts[-1]
                if SHARED_WRITERS.get(field) != module:
                    offences.append(f"{module}:{node.lineno} writes shared {field}")
            elif module not in ENGINE_MODULES and (
                parts[0] == "guard" or target.startswith("self._guard.")
            ):
                offences.append(f"{module}:{node.lineno} writes {target}")
    assert offences == [], "components ask the engine through services:\n" + "\n".join(offences)
    from guardrails._state import Shared

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
    from guardrails._component import check_components

    check_components([cls() for cls in SECTIONS.values()])


def test_the_engine_imports_no_component():
    """The engine reaches components only through the protocol, so a component can be
    removed without touching it (ARCHITECTURE.md: who may import whom)."""
    from guardrails._factory import SECTIONS

    components = {cls.__module__.rsplit(".", 1)[1] for cls in SECTIONS.values()}
    for engine in ("_guard", "_component", "_state", "_config", "_data", "_benchmark_mode"):
        tree = ast.parse((_PKG / f"{engine}.py").read_text())
        imported = set()
        for node in ast.walk(tree):  # lazy imports inside functions included
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.rsplit(".", 1)[-1])
                imported.update(a.name for a in node.names)
        assert not imported & components, f"{engine} imports {imported & components}"


def test_no_module_level_import_cycles():
    """Import order never matters: no cycle among the package's module-level imports
    (a lazy import inside a function, or one under TYPE_CHECKING, is not one)."""
    graph: dict[str, set[str]] = {}
    for path in _PKG.glob("*.py"):
        deps: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            for n in ast.walk(node):
                if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("guardrails"):
                    if n.module == "guardrails":
                        deps.update(a.name for a in n.names)
                    else:
                        deps.add(n.module.split(".")[1])
        graph[path.stem] = deps

    def visit(module: str, stack: list[str]) -> None:
        for dep in graph.get(module, ()):
            assert dep not in stack, "import cycle: " + " -> ".join([*stack, dep])
            visit(dep, [*stack, dep])

    for module in graph:
        visit(module, [module])
