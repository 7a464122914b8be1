"""The docs cannot rot silently: every relative link in README.md and docs/*.md points
at a file (and heading) that exists, docs/configuration.md lists exactly the knobs of
the code with their defaults, and docs/metrics.md exactly the columns of
metrics.parquet. No training: this reads files, dataclasses and a schema."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from guardrails._factory import SECTIONS, guard
from guardrails.engine.config import REMOVED

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
CONFIG = ROOT / "docs" / "configuration.md"

# [text](target): a markdown link; images too. Code spans are removed first, so a
# `[x](y)` shown as code is not a link.
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")


def _prose(text: str) -> str:
    return _CODE.sub("", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (``-`` and ``_``
    kept), spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(page: Path) -> list[str]:
    return [
        target
        for target in _LINK.findall(_prose(page.read_text()))
        if not re.match(r"[a-z]+:", target)  # http:, https:, mailto:
    ]


def test_the_docs_pages_exist():
    names = {p.name for p in DOCS}
    assert {"configuration.md", "failures.md", "checkpoints.md"} <= names, names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file_and_heading_that_exist(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_the_link_checker_sees_a_broken_link(tmp_path):
    # The check above must be able to fail: a missing file and a missing heading.
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n[a](missing.md) [b](page.md#nowhere) [c](#top) `[d](x.md)`\n")
    assert _links(page) == ["missing.md", "page.md#nowhere", "#top"]
    assert _anchors(page) == {"top"}
    assert _slug("`nan`: NanGuard / the knobs") == "nan-nanguard--the-knobs"


# ---------------------------------------------------------------- configuration.md


def _tables() -> dict[str, list[list[str]]]:
    """docs/configuration.md's tables, by the heading above them: each row's cells
    (the header and separator rows left out)."""
    tables: dict[str, list[list[str]]] = {}
    heading = ""
    for line in _FENCE.sub("", CONFIG.read_text()).splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
            tables[heading] = []
        elif line.startswith("|") and not re.match(r"\|\s*-", line):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0] not in ("knob", "0.1 knob", "component"):
                tables[heading].append(cells)
    return tables


def _code(cell: str) -> str:
    m = re.match(r"`([^`]*)`", cell)
    assert m, f"expected a `code` cell, got {cell!r}"
    return m.group(1)


def _documented(rows: list[list[str]]) -> dict[str, Any]:
    """knob -> its documented default (the default column, a Python literal)."""
    return {_code(r[0]): ast.literal_eval(_code(r[1])) for r in rows}


def _defaults(config: type) -> dict[str, Any]:
    return {
        f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        for f in dataclasses.fields(config)
    }


def _section_heading(name: str, tables: dict[str, list[list[str]]]) -> str:
    found = [h for h in tables if h.startswith(f"`{name}`")]
    assert len(found) == 1, f"docs/configuration.md: no (or several) `{name}` heading: {found}"
    return found[0]


@pytest.mark.parametrize("name", list(SECTIONS))
def test_every_section_knob_is_documented_with_its_default(name):
    tables = _tables()
    documented = _documented(tables[_section_heading(name, tables)])
    actual = _defaults(SECTIONS[name].Config)
    assert set(documented) == set(actual), (
        f"guard({name}=...): documented but not a field: {sorted(set(documented) - set(actual))}; "
        f"a field not documented: {sorted(set(actual) - set(documented))}"
    )
    wrong = {k: (documented[k], v) for k, v in actual.items() if documented[k] != v}
    assert not wrong, f"guard({name}=...): documented default != code default: {wrong}"


def test_every_top_level_knob_is_documented_with_its_default():
    tables = _tables()
    documented = _documented(tables[_section_heading("guard()", tables)])
    params = inspect.signature(guard).parameters.values()
    actual = {
        p.name: p.default
        for p in params
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in SECTIONS
    }
    assert set(documented) == set(actual)
    assert documented == actual


def test_the_sections_are_documented_in_run_order():
    order = [h.split("`")[1] for h in _tables() if h.startswith("`") and h != "`guard()`"]
    assert order == list(SECTIONS)


def test_every_removed_0_1_knob_is_in_the_migration_table_with_its_new_place():
    tables = _tables()
    rows = {_code(r[0]): r[1] for r in tables["Migrating from 0.1"] if len(r) == 2}
    assert set(rows) == set(REMOVED["guard"])
    for old, (where, field) in REMOVED["guard"].items():
        assert f"{where}=" in rows[old], (old, rows[old])
        if field is not None:
            assert f'"{field}"' in rows[old], (old, rows[old])
    renamed = {
        (_code(r[0]), _code(r[1])): r[2] for r in tables["Migrating from 0.1"] if len(r) == 3
    }
    want = {(k, old) for k, table in REMOVED.items() if k != "guard" for old in table}
    assert set(renamed) == want
    for (component, old), now in renamed.items():
        where, field = REMOVED[component][old]
        assert f"{component}({field}=" in now and f'{where}={{"{field}"' in now, now


def test_every_metrics_column_is_documented_with_its_type():
    from guardrails.guards.telemetry import SCHEMA

    text = _FENCE.sub("", (ROOT / "docs" / "metrics.md").read_text())
    rows = re.findall(r"^\| `(\w+)` \| (\w+) \|", text, re.M)
    arrow = {"float64": "double", "float32": "float"}  # pyarrow's names for numpy's
    assert {name: arrow.get(t, t) for name, t in rows} == {f.name: str(f.type) for f in SCHEMA}
