"""The package's layout, as ARCHITECTURE.md draws it, checked on the source (no import):

* each folder imports only its own layer and the layers below (ARCHITECTURE.md's LAYERS);
* a guard does not import another guard, except the stated exceptions;
* nothing inside imports the package itself (``import guardrails``);
* no ``_name`` is imported (or read off a module) across folders: a name another folder
  needs is public inside the package, so ``_`` keeps meaning "this folder's own";
* no module-level import cycle;
* ARCHITECTURE.md lists every module, and no module that is gone;
* its other lists are the code's: the published fields (``engine/state.py``), the
  services (each named one a Guard attribute, each of Guard's services section named),
  the sections in run order (``_factory.SECTIONS``) and ``guard()``'s flat keywords, and
  its picture draws every folder.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "guardrails"

#: Bottom first. A module imports from its own layer or a lower one; the units of one
#: layer may import each other. A unit is a folder under guardrails/ or a root module.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("_errors", "_version"),
    ("util",),
    ("distributed",),
    ("metrics",),
    ("checkpoint",),
    ("engine",),
    ("guards",),
    ("_factory",),
    ("cli", "run", "__main__", "__init__"),
)
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}

#: Guards that use another guard's module, and why (ARCHITECTURE.md repeats these).
GUARD_EXCEPTIONS = {
    ("guards.ddp", "guards.preflight"): "GuardedDDP compares parameter tables as the preflight",
    ("guards.explain", "guards.audit"): "an explained error names the last audited collective",
}


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 2:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = modules()


def unit(dotted: str) -> str:
    """``guardrails.guards.nan.guard`` -> ``guards``; ``guardrails._errors`` -> ``_errors``."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def guard_unit(dotted: str) -> str | None:
    """The guard a module belongs to: ``guards.nan`` (a folder) or ``guards.gc``."""
    parts = dotted.split(".")
    return ".".join(parts[1:3]) if len(parts) > 2 and parts[1] == "guards" else None


def folder(dotted: str) -> str:
    """The package a module sits in (``guardrails.guards.nan`` for ``...nan.spikes``)."""
    path = MODULES[dotted]
    return dotted if path.name == "__init__.py" else dotted.rsplit(".", 1)[0]


def imports(dotted: str) -> list[tuple[int, str, list[str]]]:
    """(line, module imported from, names) of every guardrails import in a module,
    lazy ones and TYPE_CHECKING ones included: all of them are dependencies."""
    tree = ast.parse(MODULES[dotted].read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "guardrails" or node.module.startswith("guardrails."):
                out.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "guardrails" or a.name.startswith("guardrails."):
                    out.append((node.lineno, a.name, []))
    return out


def targets(module: str, names: list[str]) -> list[str]:
    """The modules an import statement depends on: ``from guardrails.engine import data``
    is ``guardrails.engine.data``; ``from guardrails.engine.data import x`` the module."""
    if module in MODULES and MODULES[module].name != "__init__.py":
        return [module]
    subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
    return subs or [module]


def test_each_folder_imports_only_its_own_layer_and_below():
    assert set(LAYER_OF) == {unit(m) for m in MODULES}, "a folder or root module is missing"
    wrong = []
    for mod in MODULES:
        for line, source, names in imports(mod):
            for dep in targets(source, names):
                if LAYER_OF[unit(dep)] > LAYER_OF[unit(mod)]:
                    wrong.append(f"{MODULES[mod].relative_to(ROOT)}:{line} imports {dep}")
    assert not wrong, "imports that run up the layers:\n" + "\n".join(wrong)


def test_a_guard_imports_no_other_guard_but_the_stated_exceptions():
    found = set()
    for mod in MODULES:
        mine = guard_unit(mod)
        for line, source, names in imports(mod):
            for dep in targets(source, names):
                theirs = guard_unit(dep)
                if mine and theirs and theirs != mine:
                    found.add((mine, theirs))
                    assert (mine, theirs) in GUARD_EXCEPTIONS, (
                        f"{MODULES[mod].relative_to(ROOT)}:{line}: {mine} imports {dep}"
                    )
    assert found == set(GUARD_EXCEPTIONS), "an exception no module needs any more"


def test_nothing_inside_imports_the_package_itself():
    wrong = []
    for mod in MODULES:
        for line, source, names in imports(mod):
            if source == "guardrails" and any(f"guardrails.{n}" not in MODULES for n in names):
                wrong.append(f"{MODULES[mod].relative_to(ROOT)}:{line}")
            if source == "guardrails" and not names:  # `import guardrails`
                wrong.append(f"{MODULES[mod].relative_to(ROOT)}:{line}")
    assert not wrong, "import the defining module instead:\n" + "\n".join(wrong)


def test_no_underscore_name_crosses_a_folder():
    wrong = []
    for mod in MODULES:
        tree = ast.parse(MODULES[mod].read_text())
        foreign_modules = {}  # local alias -> module imported from another folder
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                continue
            if not node.module.startswith("guardrails."):
                continue
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in MODULES:  # a module imported by name
                    if folder(sub) != folder(mod):
                        foreign_modules[a.asname or a.name] = sub
                    continue
                private = a.name.startswith("_") and not a.name.startswith("__")
                if private and folder(node.module) != folder(mod):
                    wrong.append(f"{MODULES[mod].relative_to(ROOT)}: {node.module}.{a.name}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in foreign_modules
                and node.attr.startswith("_")
            ):
                where = f"{MODULES[mod].relative_to(ROOT)}:{node.lineno}"
                wrong.append(f"{where}: {foreign_modules[node.value.id]}.{node.attr}")
    assert not wrong, "private names used from another folder:\n" + "\n".join(sorted(wrong))


def test_no_module_level_import_cycles():
    """Import order never matters: no cycle among module-level imports (a lazy import
    inside a function, or one under TYPE_CHECKING, is not one)."""
    graph: dict[str, set[str]] = {}
    for mod, path in MODULES.items():
        deps: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            for n in ast.walk(node):
                if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("guardrails"):
                    deps.update(targets(n.module, [a.name for a in n.names]))
        graph[mod] = deps - {mod}

    def visit(module: str, stack: list[str]) -> None:
        for dep in graph.get(module, ()):
            assert dep not in stack, "import cycle: " + " -> ".join([*stack, dep])
            visit(dep, [*stack, dep])

    for module in graph:
        visit(module, [module])


# ---------------------------------------------------------------------- guard to guard
# A guard that serves another sits in a slot of engine/state.Shared typed with a
# protocol of engine/services.py; these read the source to hold every call to that.


def shared_slots() -> dict[str, str | None]:
    """``Shared``'s fields (engine/state.py), each with the protocol of
    engine/services.py that types it (``auditor: CollectiveRecorder | None``), or
    ``None`` for a plain value."""
    protocols = service_members()
    tree = ast.parse((PKG / "engine" / "state.py").read_text())
    shared = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Shared")
    slots: dict[str, str | None] = {}
    for node in shared.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = {n.id for n in ast.walk(node.annotation) if isinstance(n, ast.Name)}
            typed = sorted(names & protocols.keys())
            slots[node.target.id] = typed[0] if typed else None
    return slots


def service_members() -> dict[str, set[str]]:
    """Each protocol of engine/services.py and the members it names."""
    tree = ast.parse((PKG / "engine" / "services.py").read_text())
    out = {}
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef) and any("Protocol" in ast.unparse(b) for b in cls.bases):
            out[cls.name] = {
                n.name if isinstance(n, ast.FunctionDef) else n.target.id  # type: ignore[union-attr]
                for n in cls.body
                if isinstance(n, ast.FunctionDef)
                or (isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))
            }
    return out


def _slot_reads(scope: ast.AST) -> list[ast.Attribute]:
    """Every ``<x>.shared.<slot>`` in ``scope``, and ``s.<slot>`` where ``s`` was bound
    to ``<x>.shared`` in it (``shared = guard.shared``)."""
    aliases = {
        t.id
        for n in ast.walk(scope)
        if isinstance(n, ast.Assign)
        and isinstance(n.value, ast.Attribute)
        and n.value.attr == "shared"
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    return [
        n
        for n in ast.walk(scope)
        if isinstance(n, ast.Attribute)
        and (
            (isinstance(n.value, ast.Attribute) and n.value.attr == "shared")
            or (isinstance(n.value, ast.Name) and n.value.id in aliases)
        )
    ]


def _uses(node: ast.expr, parents: dict[ast.AST, ast.AST], scope: ast.AST) -> list[str]:
    """What is done with the service read at ``node``: ``.member`` for a member read,
    ``ok`` for a test (``is None``, ``if auditor``), ``passed on`` for anything else.
    A read bound to a local name (``auditor = guard.shared.auditor or ...``) is
    followed through that name's uses in the same function."""
    parent = parents[node]
    while isinstance(parent, (ast.BoolOp, ast.IfExp)) and node is not getattr(parent, "test", 0):
        node, parent = parent, parents[parent]
    if isinstance(parent, ast.Attribute):
        return [f".{parent.attr}"]
    if isinstance(parent, (ast.Compare, ast.If, ast.UnaryOp)) or (
        isinstance(parent, (ast.BoolOp, ast.IfExp)) and node is getattr(parent, "test", 0)
    ):
        return ["ok"]
    if isinstance(parent, ast.Return) and isinstance(scope, ast.FunctionDef) and scope.returns:
        return ["ok"]  # a typed accessor (Guard.auditor): its annotation names the protocol
    if isinstance(parent, ast.Assign) and len(parent.targets) == 1:
        target = parent.targets[0]
        if isinstance(target, ast.Name):
            out = []
            for n in ast.walk(scope):
                if isinstance(n, ast.Name) and n.id == target.id and isinstance(n.ctx, ast.Load):
                    up = parents[n]
                    if isinstance(up, ast.Call) and ast.unparse(up.func) == "getattr":
                        member = up.args[1]
                        out.append(f".{member.value}" if isinstance(member, ast.Constant) else "?")
                    else:
                        out += _uses(n, parents, scope)
            return out
    return ["passed on"]


def test_guard_to_guard_calls_go_through_the_declared_services():
    """Every ``guard.shared.<slot>`` in the package names a slot ``Shared`` declares,
    and a slot typed with a service protocol is used only through that protocol's
    members: a new call from one guard to another shows up here, and is declared in
    engine/services.py (or is refused) instead of going through an untyped slot."""
    slots, members = shared_slots(), service_members()
    assert {"auditor", "rewind"} <= {s for s, p in slots.items() if p}, slots
    wrong: set[str] = set()
    seen: set[tuple[str, str]] = set()
    for path in MODULES.values():
        tree = ast.parse(path.read_text())
        parents = {child: n for n in ast.walk(tree) for child in ast.iter_child_nodes(n)}
        scopes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
        for scope in scopes:
            for read in _slot_reads(scope):
                where = f"{path.relative_to(ROOT)}:{read.lineno}"
                if read.attr not in slots:
                    wrong.add(f"{where}: guard.shared.{read.attr} is not a Shared field")
                    continue
                protocol = slots[read.attr]
                if protocol is None or isinstance(read.ctx, ast.Store):
                    continue
                for use in _uses(read, parents, scope):
                    seen.add((read.attr, use))
                    if use == "passed on":
                        wrong.add(f"{where}: {read.attr} passed on, not called as {protocol}")
                    elif use != "ok" and use[1:] not in members[protocol]:
                        wrong.add(f"{where}: {read.attr}{use} is not in {protocol}")
    assert not wrong, "calls outside engine/services.py:\n" + "\n".join(sorted(wrong))
    # Not vacuous: the calls of today are seen.
    assert {("rewind", ".request"), ("auditor", ".record"), ("auditor", ".record_own")} <= seen


def architecture_files() -> set[str]:
    """The paths listed in ARCHITECTURE.md's "The files" block."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    block = text.split("## The files", 1)[1].split("```", 2)[1]
    return set(re.findall(r"^\s*([\w/]+\.py)\b", block, flags=re.M))


def test_architecture_lists_every_module():
    real = {
        str(p.relative_to(PKG))
        for p in PKG.rglob("*.py")
        if not (p.name == "__init__.py" and p.parent != PKG)
    }
    listed = architecture_files()
    assert real - listed == set(), "modules missing from ARCHITECTURE.md"
    assert listed - real == set(), "ARCHITECTURE.md lists modules that do not exist"


@pytest.mark.parametrize("pair", sorted(GUARD_EXCEPTIONS))
def test_architecture_states_each_guard_exception(pair):
    text = (ROOT / "ARCHITECTURE.md").read_text()
    mine, theirs = (p.split(".", 1)[1] for p in pair)
    assert re.search(rf"`{mine}[/.]\S*` uses\s+`{theirs}/", text), pair


def test_a_new_section_is_one_entry_in_sections(tmp_path, monkeypatch):
    """Adding a default guard to guard() is one line in SECTIONS: the keyword, its
    Config, its validation and the closest-name hint follow from it."""
    import dataclasses

    import torch

    import guardrails
    from guardrails import _factory

    class Plateau(guardrails.Component):
        """A stand-in new guard: counts the steps it saw."""

        name = "plateau"

        @dataclasses.dataclass
        class Config:
            """patience_steps: steps without improvement before it speaks."""

            patience_steps: int = 100

        def __init__(self, config=None, /, **knobs):
            guardrails.engine.config.configure(self, config, knobs)
            self.seen = 0

        def after_step(self, guard):
            self.seen += 1

    monkeypatch.setitem(_factory.SECTIONS, "plateau", Plateau)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(3)]
    with guardrails.guard(
        model, opt, data, run_dir=tmp_path, progress=False, plateau={"patience_steps": 7}
    ) as g:
        for x, y in g:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    (mine,) = [c for c in g.components if isinstance(c, Plateau)]
    assert (mine.patience_steps, mine.seen) == (7, 3)
    with pytest.raises(TypeError, match="patience_step.*patience_steps"):
        guardrails.guard(model, opt, data, run_dir=tmp_path, plateau={"patience_step": 1})
    with pytest.raises(TypeError, match="Did you mean `plateau`"):
        guardrails.guard(model, opt, data, run_dir=tmp_path, plateu=False)
    g = guardrails.guard(model, opt, data, run_dir=tmp_path, plateau=False)
    assert not any(isinstance(c, Plateau) for c in g.components)


# ------------------------------------------------ ARCHITECTURE.md's lists, against the code


def _page() -> str:
    return (ROOT / "ARCHITECTURE.md").read_text()


def _between(text: str, start: str, end: str) -> str:
    """The text after ``start`` (a line break where it has a space) up to ``end``."""
    found = re.search(r"\s+".join(map(re.escape, start.split(" "))), text)
    assert found, f"ARCHITECTURE.md no longer says {start!r}"
    rest = text[found.end() :]
    assert end in rest, f"ARCHITECTURE.md no longer says {end!r} after {start!r}"
    return rest.split(end, 1)[0]


def _names(text: str) -> list[str]:
    """The lower-case identifiers opening a backtick span (`step`, `request_stop(...)`),
    in order: not `Guard`, `None`, `engine/guard.py` or `guard.step`."""
    return re.findall(r"`([a-z_][a-z0-9_]*)(?=[`(])", text)


def _class_node(path: Path, name: str) -> ast.ClassDef:
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    return node


def test_architecture_lists_every_published_field():
    """The page's StepState and Shared fields are engine/state.py's, no more, no less."""
    init = next(
        n
        for n in _class_node(PKG / "engine" / "state.py", "StepState").body
        if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    )
    step_state = {
        t.attr
        for n in ast.walk(init)
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    shared = {
        n.target.id
        for n in _class_node(PKG / "engine" / "state.py", "Shared").body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    page = _page()
    listed_step = set(_names(_between(page, "- `StepState`", "- `Shared`")))
    listed_shared = set(_names(_between(page, "- `Shared`", "\n\n")))
    assert listed_step == step_state, (
        f"StepState fields missing from the page: {sorted(step_state - listed_step)}; "
        f"listed but gone: {sorted(listed_step - step_state)}"
    )
    assert listed_shared == shared, (
        f"Shared fields missing from the page: {sorted(shared - listed_shared)}; "
        f"listed but gone: {sorted(listed_shared - shared)}"
    )


def _guard_services() -> set[str]:
    """The public methods and properties of ``Guard``'s services section (between its
    ``# --- services`` comment and the next section's)."""
    path = PKG / "engine" / "guard.py"
    lines = path.read_text().splitlines()
    marks = [i for i, ln in enumerate(lines, 1) if re.match(r"^    # -{20,} \w", ln)]
    starts = [i for i in marks if lines[i - 1].rstrip().endswith(" services")]
    assert len(starts) == 1, "engine/guard.py: Guard's `# --- services` section not found"
    end = min((i for i in marks if i > starts[0]), default=len(lines) + 1)
    body = _class_node(path, "Guard").body
    return {
        n.name
        for n in body
        if isinstance(n, ast.FunctionDef)
        and starts[0] < n.lineno < end
        and not n.name.startswith("_")
    }


def test_architecture_names_every_service_and_only_real_ones():
    """Each service the page names is a public attribute of Guard, and each public
    method of Guard's services section is named on the page."""
    from guardrails.engine.guard import Guard

    page = _page()
    named = set(_names(_between(page, "asks through a **service** of `Guard`:", "\n\n")))
    gone = sorted(n for n in named if not hasattr(Guard, n))
    assert not gone, f"ARCHITECTURE.md names services Guard does not have: {gone}"
    everywhere = set(_names(page))
    missing = sorted(_guard_services() - everywhere)
    assert not missing, f"services of Guard that ARCHITECTURE.md does not name: {missing}"


def _guard_keywords() -> list[str]:
    """guard()'s flat keyword-only parameters, in order (not the typed sections)."""
    tree = ast.parse((PKG / "_factory.py").read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "guard"]
    return [a.arg for a in fn.args.kwonlyargs if a.arg not in _sections()]


def _sections() -> list[str]:
    """_factory.SECTIONS' keys, in order, read from the source."""
    tree = ast.parse((PKG / "_factory.py").read_text())
    for n in tree.body:
        if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", None) == "SECTIONS":
            assert isinstance(n.value, ast.Dict)
            return [k.value for k in n.value.keys if isinstance(k, ast.Constant)]
    raise AssertionError("_factory.py has no SECTIONS")


def test_architecture_lists_guards_sections_and_keywords():
    """The page's sections (in run order) are SECTIONS', and its flat knobs are
    guard()'s keyword-only parameters."""
    page = _page()
    listed = _names(_between(page, "to its component, in run order:", "A section is"))
    assert listed == _sections(), "ARCHITECTURE.md's sections differ from _factory.SECTIONS"
    flat = _names(_between(page, "A few top-level knobs users set most (", ")"))
    assert sorted(flat) == sorted(_guard_keywords()), (
        f"guard() keywords missing from the page: {sorted(set(_guard_keywords()) - set(flat))}"
        f"; listed but gone: {sorted(set(flat) - set(_guard_keywords()))}"
    )


def test_architecture_picture_shows_every_folder():
    """The folder picture names every folder of the package and every guard folder."""
    picture = _page().split("## The folders, bottom to top", 1)[1].split("```", 2)[1]
    drawn = set(re.findall(r"\b(\w+)/", picture))
    folders = {p.parent.name for p in PKG.glob("*/__init__.py")}
    folders |= {p.parent.name for p in (PKG / "guards").glob("*/__init__.py")}
    assert folders - drawn == set(), "folders missing from ARCHITECTURE.md's picture"
