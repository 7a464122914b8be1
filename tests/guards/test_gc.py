"""GCScheduler against the real interpreter GC: aligned collections, measured pauses,
and the previous GC state back exactly."""

from __future__ import annotations

import gc
import logging
import weakref
from collections import deque

import pytest
import torch
from conftest import Regressor, batches, guarded_run, read_events, train_loop

import guardrails
from guardrails import GCScheduler, Guard, Telemetry


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic GC frees it


def train_with_garbage(tmp_path, sched, n_steps=10, garbage_per_step=3000, **guard_kw):
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    enabled_inside = []
    with Guard(model, opt, batches(n_steps), run_dir=tmp_path, components=[sched], **guard_kw) as g:
        # Not train_loop: garbage made every step, gc's state read after each.
        for x, y in g:
            for _ in range(garbage_per_step):  # well over gen-0's threshold (700) per step
                Node()
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            enabled_inside.append(gc.isenabled())
    return enabled_inside


def test_collections_happen_only_at_scheduled_steps(tmp_path):
    sched = GCScheduler(every_n_steps=3)
    enabled_inside = train_with_garbage(tmp_path, sched)
    # None automatic from the start; step 1: one full collection and the freeze; then
    # generation 1 every 3 steps. The garbage per step would trigger ~4 automatic ones.
    assert [(step, gen) for step, gen, _, _ in sched.pauses] == [(1, 2), (3, 1), (6, 1), (9, 1)]
    assert enabled_inside == [False] * 10  # no automatic collection after step 1
    assert all(collected >= 3000 for step, _, _, collected in sched.pauses if step > 1)
    frozen = [e for e in read_events(tmp_path) if e["kind"] == "gc_frozen"]
    assert len(frozen) == 1 and frozen[0]["step"] == 1 and frozen[0]["frozen"] > 0


def test_full_collections_on_their_own_interval(tmp_path):
    sched = GCScheduler(every_n_steps=2, full_every_n_steps=4)
    train_with_garbage(tmp_path, sched, n_steps=8, garbage_per_step=10)
    assert [(s, g) for s, g, _, _ in sched.pauses] == [(1, 2), (2, 1), (4, 2), (6, 1), (8, 2)]


def test_previous_gc_state_comes_back_exactly(tmp_path):
    before_threshold = gc.get_threshold()
    gc.set_threshold(1234, 7, 3)
    try:
        train_with_garbage(tmp_path, GCScheduler(every_n_steps=3), n_steps=4, garbage_per_step=10)
        assert gc.isenabled()
        assert gc.get_threshold() == (1234, 7, 3)
        assert gc.get_freeze_count() == 0
        assert not any(
            getattr(cb, "__self__", None).__class__ is GCScheduler for cb in gc.callbacks
        )

        gc.disable()
        train_with_garbage(tmp_path, GCScheduler(every_n_steps=3), n_steps=4, garbage_per_step=10)
        assert not gc.isenabled()  # it was off before: stays off
    finally:
        gc.enable()
        gc.set_threshold(*before_threshold)


def test_state_restored_when_the_loop_raises(tmp_path):
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ZeroDivisionError):
        with Guard(model, opt, batches(5), run_dir=tmp_path, components=[GCScheduler()]) as g:
            for i, (x, y) in enumerate(g):
                model(x, y).backward()
                opt.step()
                opt.zero_grad()
                if i == 2:
                    1 / 0  # noqa: B018
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_an_application_freeze_is_respected(tmp_path):
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        train_with_garbage(tmp_path, GCScheduler(every_n_steps=3), n_steps=3, garbage_per_step=10)
        # Neither unfrozen nor added to (frozen objects can still die by refcount).
        assert 0 < gc.get_freeze_count() <= count
        kinds = [e["kind"] for e in read_events(tmp_path)]
        assert "gc_freeze_skipped" in kinds
    finally:
        gc.unfreeze()


def test_pauses_land_in_metrics_and_long_ones_in_events(tmp_path):
    sched = GCScheduler(every_n_steps=3, long_pause_s=0.0)  # every pause counts as long
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # The scheduler before telemetry (guard()'s order): each pause is in its own step's
    # row. In the other order a pause is counted in the next step's row, never lost.
    with Guard(model, opt, batches(7), run_dir=tmp_path, components=[sched, Telemetry()]) as g:
        # Not train_loop: 2,000 cyclic objects made every step.
        for x, y in g:
            for _ in range(2000):
                Node()
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    rows = guardrails.read_metrics(tmp_path).to_pydict()
    by_step = dict(zip(rows["step"], rows["gc_s"], strict=True))
    assert {s for s, v in by_step.items() if v > 0} == {1, 3, 6}
    assert sum(by_step.values()) == pytest.approx(sum(p for _, _, p, _ in sched.pauses))
    long = [e for e in read_events(tmp_path) if e["kind"] == "gc_pause"]
    assert [e["step"] for e in long] == [1, 3, 6] and long[1]["generation"] == 1
    assert [(e["scheduled"], e["level"]) for e in long] == [
        ("freeze", "info"),
        ("scheduled", "warning"),
        ("scheduled", "warning"),
    ]
    # The remedy in the user's terms: the knob as guard() takes it, with a value.
    assert "guard(..., gc={'every_n_steps': 1}) (now 3)" in long[1]["message"]
    assert "gc={'long_pause_s': ...}" in long[1]["message"]


def test_an_unscheduled_collection_is_named_as_such(tmp_path):
    def inside(g):
        gc.collect()  # someone else's collection inside the guarded block

    from conftest import guarded_run

    guarded_run(tmp_path, 2, inside=inside)
    pauses = [
        e for e in read_events(tmp_path) if e["kind"] == "gc_pause" and e["scheduled"] is None
    ]
    # Only reported when long; the full collection here may or may not pass 0.1 s, so
    # check the wording through a zero threshold instead.
    sched = GCScheduler(long_pause_s=0.0)
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Guard(model, opt, batches(2), run_dir=tmp_path / "b", components=[sched]) as g:
        train_loop(g, model, opt)
        gc.collect()
    ours = [e for e in read_events(tmp_path / "b") if e["kind"] == "gc_pause"]
    assert ours[-1]["scheduled"] is None and ours[-1]["level"] == "warning"
    assert "not scheduled by guardrails" in ours[-1]["message"]
    assert all(e["level"] == "warning" for e in pauses)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"generation": 3}, "generation"),
        ({"full_every_n_steps": 0}, "full_every_n_steps"),
        ({"long_pause_s": -1}, "long_pause_s"),
    ],
)
def test_bad_knobs(kw, match):
    with pytest.raises(ValueError, match=match):
        GCScheduler(**kw)


def test_an_application_that_manages_the_gc_during_the_run_keeps_its_settings(tmp_path):
    # nanochat: after its first step, gc.collect(); gc.freeze(); gc.disable(). Closing
    # the guard must not re-enable the GC nor unfreeze what the application froze.
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with Guard(model, opt, batches(4), run_dir=tmp_path, components=[GCScheduler()]) as g:
            # Not train_loop: the loop itself freezes and disables gc at step 1.
            for x, y in g:
                model(x, y).backward()
                opt.step()
                opt.zero_grad()
                if g.step == 1:
                    keep = [[] for _ in range(100)]  # noqa: F841 (objects the app freezes)
                    gc.collect()
                    gc.freeze()
                    gc.disable()
        assert not gc.isenabled() and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.enable()


def test_a_resumed_run_freezes_after_its_own_first_step(tmp_path):
    guarded_run(tmp_path, n_steps=3, checkpoint={"every_n_steps": 3})
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guardrails.guard(model, opt, batches(6), run_dir=tmp_path) as g:
        assert g.step == 3
        # Not train_loop: the freeze is checked inside step 4.
        for x, y in g:
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            if g.step == 4:
                assert gc.get_freeze_count() > 0  # frozen after step 4, this run's first
    frozen = [e for e in read_events(tmp_path) if e["kind"] == "gc_frozen"]
    assert [e["step"] for e in frozen] == [1, 4]
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_a_collection_inside_torch_compile_is_information_not_a_warning(tmp_path):
    # torch.compile calls gc.collect() while it compiles (the first step's forward):
    # a long pause there is not a stall of the loop's making. The compiler is stood in
    # for by code whose file is under torch/_dynamo, as the collector's stack shows it.
    compiler = {}
    exec(
        compile("def compile_graph():\n    gc.collect()\n", "torch/_dynamo/x.py", "exec"),
        {"gc": gc},
        compiler,
    )
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = GCScheduler(long_pause_s=0.0)
    with Guard(model, opt, batches(3), run_dir=tmp_path, components=[sched]) as g:
        for i, (x, y) in enumerate(g):
            if i == 0:
                compiler["compile_graph"]()
            if i == 2:
                gc.collect()  # the application's own: still a warning
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    pauses = [e for e in read_events(tmp_path) if e["kind"] == "gc_pause" and not e["scheduled"]]
    assert [(e["step"], e["level"]) for e in pauses] == [(0, "info"), (2, "warning")]
    assert "torch.compile" in pauses[0]["message"]


class Held:
    """A reference cycle holding 64 KB, alive for ``KEEP`` steps (a cache of recent
    batches): it outlives the young collection that runs every 100 steps, so that
    collection promotes it to the oldest generation, which only a full one scans."""

    def __init__(self, freed: list[int]) -> None:
        self.me = self
        self.payload = bytearray(64 * 1024)
        weakref.finalize(self, freed.append, 1)  # counts the cycle when it is freed


def _train_with_long_lived_cycles(run_dir, gc_section, n_steps: int, keep: int = 150):
    """``n_steps`` under guard() with every default component; each step makes one
    ``Held`` cycle kept ``keep`` steps. Returns (cycles freed by the end of step 2000,
    cycles dead by then, the closed guard)."""
    freed: list[int] = []
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recent: deque[Held] = deque(maxlen=keep)
    at_2000 = None
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, 4, generator=gen) for _ in range(8)]
    data = [(x, x.sum(1)) for x in xs] * (n_steps // 8 + 1)  # learnable: the loss falls
    with guardrails.guard(
        model, opt, data[:n_steps], run_dir=run_dir, progress=False, gc=gc_section
    ) as g:
        # Not train_loop: a cycle made every step, the count read at step 2000.
        for x, y in g:
            if g.step == 2000:  # read before this step makes anything: step 2000 is done
                at_2000 = len(freed)
            recent.append(Held(freed))
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    # Steps are 0-based in the loop body: the cycle made in body i (step i + 1 after
    # it) is dropped in body i + keep, so by the end of step 2000 the cycles of bodies
    # 0..(1999 - keep) are garbage. Body 0's was alive at the freeze: frozen for good.
    dead = 2000 - keep
    return at_2000, dead, g


@pytest.mark.slow(reason="a guarded run building cyclic garbage until collections run: ~3 CPU-s")
def test_cycles_that_outlive_a_young_collection_are_freed_by_default(tmp_path, caplog):
    """A month-long run must not keep every cycle that lived through one scheduled
    collection: before full collections ran by default, none of the 1,850 dead cycles
    here was freed (115 MB held). Counted by finalizers, not by memory or time."""
    caplog.set_level(logging.WARNING, logger="guardrails")
    freed, dead, g = _train_with_long_lived_cycles(tmp_path / "default", True, 2001)
    assert freed >= dead - 1, (freed, dead)  # all but the frozen one
    sched = g.component("gc")
    fulls = [step for step, gen, _, _ in sched.pauses if gen == 2]
    assert fulls == [1, 1000, 2000], fulls  # the freeze's, then every 1000 steps
    # A healthy run stays silent: no warning logged, no warning event, no leak report.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    events = read_events(tmp_path / "default")
    assert not [e for e in events if e.get("level") == "warning"], events
    assert not [e for e in events if e["kind"] == "leak"]
    # A pause event, if any, is the freeze's (info): the full collections were short.
    assert all(e["scheduled"] == "freeze" for e in events if e["kind"] == "gc_pause")

    # Turned off, the same loop keeps them all: what the default prevents.
    kept, _, _ = _train_with_long_lived_cycles(tmp_path / "off", {"full_every_n_steps": None}, 2001)
    assert kept == 0, kept
