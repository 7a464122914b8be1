"""Rewind (``guard(rewind=...)``, off by default): on a divergence or a streak of
non-finite steps, back to an in-memory snapshot from before the trouble, past its
batches, and on. Real loops; the multi-rank cases are real gloo ranks under DDP
(``tests/rewind_worker.py``), launched together by one module fixture."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _ranks import launch, wait_all
from conftest import read_events
from torch.optim.optimizer import register_optimizer_step_pre_hook

import guardrails
from guardrails.guards.rewind.rewind import Rewind

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rewind_worker  # its model and data, for the in-process runs

WORKER = Path(__file__).resolve().parents[1] / "rewind_worker.py"
KNOBS = {"snapshot_every_steps": 20, "skip_batches": 10}


def _local_run(
    run_dir, fault="none", rewind=KNOBS, *, steps=200, at=100, length=15, hook=None, **guard_knobs
):
    """rewind_worker's loop in this process (one rank): ``(guard, net, losses)``. Faults
    ``div`` / ``nan`` / ``cut`` as there; several runs of bad batches with ``at`` a list;
    ``hook(g, opt, "before" | "after")`` around each ``opt.step()``."""
    torch.manual_seed(0)
    net = rewind_worker.Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    warm = steps // 10
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            (s + 1) / warm
            if s < warm
            else 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warm) / (steps - warm))))
        ),
    )
    data = rewind_worker.data(0, steps, "none", 0, 0)
    for start in at if isinstance(at, list) else [at]:
        bad = rewind_worker.data(0, steps, fault, start, length)
        if fault == "cut":
            data = bad
        else:
            data = [
                b if start <= i < start + length else d
                for i, (d, b) in enumerate(zip(data, bad, strict=True))
            ]
    knobs = {} if rewind is None else {"rewind": rewind}
    losses = []
    with guardrails.guard(
        net, opt, data, scheduler=sched, run_dir=run_dir, progress=False, **knobs, **guard_knobs
    ) as g:
        for x, y in g:
            loss = net(x, y)
            loss.backward()
            if hook is not None:
                hook(g, opt, "before")
            opt.step()
            if hook is not None:
                hook(g, opt, "after")
            opt.zero_grad()
            sched.step()
            losses.append(loss.item())
    return g, net, losses


def _kinds(run_dir, *kinds):
    return [e for e in read_events(run_dir) if e["kind"] in kinds]


def _tail(losses, n=20):
    return sum(losses[-n:]) / n


# ---------------------------------------------------------------- 2 ranks (DDP, gloo)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """Five 2-rank DDP jobs, the first four at once: a divergence on rank 1 alone (rewind
    on), a clean run (the bad batches cut; rewind on, periodic saves: a healthy run),
    non-finite batches on both ranks with rewind on (periodic saves) and off, and the
    same faulted run stopped by SIGTERM after its rewind, then resumed by the same
    command."""
    root = tmp_path_factory.mktemp("rewind")
    rw = json.dumps(KNOBS)
    jobs = {
        "div1": ["--fault", "div", "--fault-rank", "1", "--rewind", rw],
        "cut": ["--fault", "cut", "--rewind", rw, "--ckpt-every", "30"],
        "nan": ["--fault", "nan", "--rewind", rw, "--ckpt-every", "30"],
        "nan_off": ["--fault", "nan"],
        "stop": ["--fault", "nan", "--rewind", rw, "--ckpt-every", "30", "--sigterm-at", "105"],
    }
    started = {}
    for name, args in jobs.items():
        out = root / name
        out.mkdir()
        argv = [sys.executable, str(WORKER), str(out / "run"), str(out), *args]
        started[name] = launch(argv, 2, out=out, error_files=True)
    wait_all(started, timeout_s=240, fail=False)
    results = {name: job.results() for name, job in started.items()}
    # The same command again (without the SIGTERM): resumes the stopped run.
    out = root / "stop"
    resumed = launch(
        [sys.executable, str(WORKER), str(out / "run"), str(out), *jobs["stop"][:-2]],
        2,
        out=out / "resumed",
    )
    (out / "resumed").mkdir(exist_ok=True)
    wait_all({"resumed": resumed}, timeout_s=180, fail=False)
    results["resumed"] = resumed.results()
    return root, results


def _final(root, name, rank=0):
    return torch.load(root / name / f"rank{rank}.pt")


@pytest.mark.slow(reason="five 2-rank DDP jobs of 200 steps (~30 s on 2 busy cores)")
def test_a_divergence_on_one_rank_rewinds_every_rank_at_the_same_step(ddp):
    root, results = ddp
    for name in ("div1", "cut"):
        assert [r.code for r in results[name]] == [0, 0], (name, results[name][0].out[-3000:])
    clean = _tail(_final(root, "cut")["losses"])
    for name in ("div1",):
        events = _kinds(root / name / "run", "rewind")
        assert sorted(e["rank"] for e in events) == [0, 1], events
        a, b = events
        # The same step on both ranks, to the same snapshot, from before the trouble.
        for key in ("step", "from_step", "to_step", "start", "batches_skipped", "cause"):
            assert a[key] == b[key], (key, a, b)
        assert a["cause"] == "divergence" and a["start"] == 101 and a["to_step"] == 100
        assert a["from_step"] % KNOBS["snapshot_every_steps"] == 0  # read at a snapshot step
        assert a["batches_skipped"]["dropped"] == 10 and a["rewinds"] == 1
        assert "rewound from step" in a["message"] and "the next 10 dropped" in a["message"]
        # It finished, its loss as low as the clean run's, which never saw those batches.
        final = _final(root, name)
        assert math.isfinite(final["losses"][-1])
        assert abs(_tail(final["losses"]) - clean) < 0.03 * clean, (name, clean)
    # Rank 1 alone saw it: rank 0's event says so.
    (r0,) = [e for e in _kinds(root / "div1" / "run", "rewind") if e["rank"] == 0]
    assert "seen by another rank" in r0["message"]
    assert [e["rank"] for e in _kinds(root / "div1" / "run", "divergence")] == [1]


@pytest.mark.slow(reason="reads the module's 2-rank jobs")
def test_a_healthy_run_with_rewind_on_never_rewinds(ddp):
    # Warmup then cosine decay, evaluation pauses, a periodic checkpoint every 30 steps.
    root, results = ddp
    assert [r.code for r in results["cut"]] == [0, 0]
    run = root / "cut" / "run"
    assert _kinds(run, "rewind", "rewind_failed", "divergence", "nonfinite") == []
    assert len(_kinds(run, "checkpoint")) >= 6
    assert _final(root, "cut")["step"] == 185


@pytest.mark.slow(reason="reads the module's 2-rank jobs")
def test_a_nonfinite_streak_rewinds_instead_of_raising_and_without_rewind_raises(ddp):
    root, results = ddp
    assert [r.code for r in results["nan"]] == [0, 0]
    events = _kinds(root / "nan" / "run", "rewind")
    assert len(events) == 2 and {e["rank"] for e in events} == {0, 1}
    e = events[0]
    assert (e["cause"], e["start"], e["from_step"], e["to_step"]) == ("nonfinite", 101, 110, 100)
    assert e["trouble"]["skipped"] == 10 and e["trouble"]["diagnosis"] == "bad_data"
    assert "10 non-finite steps in a row from step 101" in e["message"]
    assert e["batches_skipped"] == {"steps": 10, "from": [0, 100], "to": [0, 110], "dropped": 10}
    final = _final(root, "nan")
    assert final["step"] == 200 - 10 - 10 and math.isfinite(final["losses"][-1])
    assert abs(_tail(final["losses"]) - _tail(_final(root, "cut")["losses"])) < 0.03
    # Off: today's behaviour, NonFiniteError (exit code 81) on every rank, no rewind.
    assert [r.code for r in results["nan_off"]] == [81, 81]
    assert "max_consecutive_skips=10" in results["nan_off"][0].out
    assert _kinds(root / "nan_off" / "run", "rewind") == []


@pytest.mark.slow(reason="reads the module's 2-rank jobs")
def test_a_checkpoint_saved_after_a_rewind_resumes_bitwise(ddp):
    root, results = ddp
    assert [r.code for r in results["stop"]] == [143, 143], results["stop"][0].out[-2000:]
    assert [r.code for r in results["resumed"]] == [0, 0], results["resumed"][0].out[-3000:]
    # The stopped run rewound as the uninterrupted one did (same step, same snapshot)...
    first = {
        (e["rank"], e["from_step"], e["to_step"]) for e in _kinds(root / "nan" / "run", "rewind")
    }
    again = {
        (e["rank"], e["from_step"], e["to_step"]) for e in _kinds(root / "stop" / "run", "rewind")
    }
    said = f"{_kinds(root / 'stop' / 'run', 'stopped')}\n{_kinds(root / 'stop' / 'run', 'resumed')}"
    assert first == again, said
    # ...and, stopped after it and resumed from the checkpoint, ends bitwise the same.
    for rank in (0, 1):
        a, b = _final(root, "nan", rank), _final(root, "stop", rank)
        assert a["step"] == b["step"]
        for k in a["model"]:
            assert torch.equal(a["model"][k], b["model"][k]), (rank, k)


# ---------------------------------------------------------------- one process


@pytest.mark.slow(reason="three 200-step runs in this process (~6 s on 2 busy cores)")
def test_a_rerun_with_the_same_faults_rewinds_the_same_way_bitwise(tmp_path):
    g1, net1, losses = _local_run(tmp_path / "a", "div")
    _, net2, _ = _local_run(tmp_path / "b", "div")
    _, _, clean = _local_run(tmp_path / "c", "cut")
    # It finished, as low as the run that never saw the bad batches.
    assert abs(_tail(losses) - _tail(clean)) < 0.03 * _tail(clean), (_tail(losses), _tail(clean))
    e1, e2 = _kinds(tmp_path / "a", "rewind"), _kinds(tmp_path / "b", "rewind")
    assert len(e1) == 1 and [{k: v for k, v in e.items() if k != "time"} for e in e1] == [
        {k: v for k, v in e.items() if k != "time"} for e in e2
    ]
    assert (e1[0]["start"], e1[0]["to_step"], e1[0]["from_step"]) == (101, 100, 110)
    for k, v in net1.state_dict().items():
        assert torch.equal(v, net2.state_dict()[k]), k
    rw = next(c for c in g1.components if isinstance(c, Rewind))
    assert rw.used == 1 and rw.rewinds[0]["to_step"] == 100


@pytest.mark.slow(reason="two 200-step runs in this process (~4 s on 2 busy cores)")
def test_more_troubles_than_max_rewinds_get_todays_error_after_the_cap(tmp_path):
    # Three streaks of 12 non-finite batches; two rewinds allowed: the third raises.
    # (Each rewind goes back 10 steps and drops 10 batches: the steps lag the data.)
    with pytest.raises(guardrails.NonFiniteError, match="max_consecutive_skips=10") as info:
        _local_run(tmp_path, "nan", {**KNOBS, "max_rewinds": 2}, at=[40, 90, 140], length=12)
    assert info.value.step == 91  # the third streak's first step
    events = _kinds(tmp_path, "rewind")
    assert [(e["start"], e["to_step"], e["rewinds"]) for e in events] == [(41, 40, 1), (71, 60, 2)]
    assert all(e["max_rewinds"] == 2 for e in events)
    # Without rewind the first streak already raises (today's behaviour).
    with pytest.raises(guardrails.NonFiniteError):
        _local_run(tmp_path / "off", "nan", None, at=[40], length=12)


@pytest.mark.slow(reason="two 200-step runs in this process (~4 s on 2 busy cores)")
def test_off_is_a_no_op_and_a_divergence_stays_a_warning(tmp_path):
    g, _, _ = _local_run(tmp_path, "div", None)
    assert g.shared.rewind is None and not any(isinstance(c, Rewind) for c in g.components)
    assert len(_kinds(tmp_path, "divergence")) == 1 and _kinds(tmp_path, "rewind") == []
    assert (
        "rewind" not in next(e for e in read_events(tmp_path) if e["kind"] == "start")["components"]
    )
    # On: the snapshots' host memory is the only memory it holds (none when off).
    g, _, _ = _local_run(tmp_path / "on", "none", KNOBS)
    rw = next(c for c in g.components if isinstance(c, Rewind))
    assert rw.used == 0 and rw.rewinds == [] and g.shared.rewind is None  # released at close


@pytest.mark.slow(reason="a 200-step run in this process (~2 s on 2 busy cores)")
def test_the_lr_is_scaled_after_a_rewind_and_put_back_after_each_update(tmp_path):
    rows = []  # [step, the loop's LR before opt.step(), the LR it updated with, after]

    def hook(g, opt, when):
        lr = opt.param_groups[0]["lr"]
        if when == "before":
            rows.append([g.step + 1, lr])
        else:
            rows[-1].append(lr)

    def pre(opt, args, kwargs):  # inside the optimizer's step: the LR it updates with
        rows[-1].append(opt.param_groups[0]["lr"])

    handle = register_optimizer_step_pre_hook(pre)
    try:
        _local_run(tmp_path, "nan", {**KNOBS, "lr_scale": 0.1, "lr_warmup_steps": 4}, hook=hook)
    finally:
        handle.remove()
    (e,) = _kinds(tmp_path, "rewind")
    assert e["lr_scale"] == 0.1 and e["lr_warmup_steps"] == 4 and e["to_step"] == 100
    after = [r for r in rows if r[0] == 101][-1]
    i = len(rows) - 1 - rows[::-1].index(after)
    for k, factor in enumerate((0.1, 0.325, 0.55, 0.775, 1.0)):
        _, loop_lr, used, after_lr = rows[i + k]
        assert math.isclose(used, factor * loop_lr, rel_tol=1e-12), (k, rows[i + k])
        assert after_lr == loop_lr  # put back right after the update
    # Before the rewind, never scaled (a skipped step never reaches the optimizer).
    assert all(r[2] == r[1] for r in rows[:i] if len(r) == 4)


@pytest.mark.slow(reason="a 120-step run with periodic saves in this process (~3 s)")
def test_without_a_snapshot_old_enough_a_checkpoint_from_before_the_trouble_is_used(tmp_path):
    # Snapshots every 4 steps: when the streak of steps 61-70 is found, the two held
    # (steps 64 and 68) are after it began; the periodic checkpoint of step 60 is not.
    ckpt = {"every_n_steps": 10, "background": False}
    _, net, _ = _local_run(
        tmp_path, "nan", {"snapshot_every_steps": 4}, steps=120, at=60, length=12, checkpoint=ckpt
    )
    (e,) = _kinds(tmp_path, "rewind")
    assert (e["start"], e["from_step"], e["to_step"]) == (61, 70, 60)
    assert e["source"].endswith("step_000000060") and e["batches_skipped"]["from"] == [0, 60]
    assert "(checkpoint " in e["message"] and "step_000000060" in e["message"]
    assert all(torch.isfinite(p).all() for p in net.parameters())
    # No checkpoint from before it either: today's NonFiniteError.
    with pytest.raises(guardrails.NonFiniteError):
        _local_run(
            tmp_path / "none", "nan", {"snapshot_every_steps": 4}, steps=120, at=60, length=12
        )
    assert _kinds(tmp_path / "none", "rewind") == []


@pytest.mark.slow(reason="a 120-step run with periodic saves in this process (~3 s)")
def test_the_checkpoint_fallback_follows_no_link_and_never_goes_back_into_one_twice(tmp_path):
    # Issue 52: rewind's fallback followed a symlinked step directory that resume skips.
    # At step 65 the checkpoint of step 60 is swapped for a link to a copy elsewhere:
    # the rewind (the streak of steps 61-70) refuses it, says why, and takes step 50.
    import shutil

    root = tmp_path / "run" / "checkpoints"

    def swap(g, opt, when):
        if when == "after" and g.step == 65 and not (tmp_path / "elsewhere").exists():
            shutil.copytree(root / "step_000000060", tmp_path / "elsewhere")
            shutil.rmtree(root / "step_000000060")
            (root / "step_000000060").symlink_to(tmp_path / "elsewhere")

    ckpt = {"every_n_steps": 10, "background": False}
    knobs = {"snapshot_every_steps": 4}
    _local_run(
        tmp_path / "run", "nan", knobs, steps=120, at=60, length=12, checkpoint=ckpt, hook=swap
    )
    (refused,) = _kinds(tmp_path / "run", "rewind_checkpoint_invalid")
    assert "step_000000060 is a link" in refused["message"], refused
    (e,) = _kinds(tmp_path / "run", "rewind")
    assert (e["from_step"], e["to_step"]) == (70, 50)
    assert e["source"].endswith("step_000000050")
    # Bad batches right after the checkpoint it went back to: the same streak again,
    # which no snapshot reaches. The checkpoint already gone back into once is not
    # used again (a forged one that loads diverges again, and the rewinds went back
    # into it until max_rewinds): the next one back is.
    _local_run(
        tmp_path / "two",
        "nan",
        {**knobs, "max_rewinds": 5},
        steps=120,
        at=60,
        length=24,
        checkpoint=ckpt,
    )
    back = [(e["to_step"], Path(e["source"]).name) for e in _kinds(tmp_path / "two", "rewind")]
    assert back[:2] == [(60, "step_000000060"), (50, "step_000000050")], back


@pytest.mark.slow(reason="three 200-step runs in this process (~5 s)")
def test_a_stop_at_the_rewinds_step_saves_the_drop_still_to_come_and_resumes_bitwise(tmp_path):
    # SIGTERM during step 110, the streak's tenth: at that boundary the rewind goes
    # back to step 100, then the stop saves, with the 10 batches still to drop.
    import os
    import signal

    knobs = {**KNOBS, "lr_scale": 0.5, "lr_warmup_steps": 5}

    def sigterm(g, opt, when):
        if when == "before" and g.step == 109:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(SystemExit) as info:
        _local_run(tmp_path / "a", "nan", knobs, at=100, length=12, hook=sigterm)
    assert info.value.code == 143
    (e,) = _kinds(tmp_path / "a", "rewind")
    assert (e["from_step"], e["to_step"]) == (110, 100)
    (ckpt,) = (tmp_path / "a" / "checkpoints").glob("step_*")
    assert ckpt.name == "step_000000100"
    saved = json.loads((ckpt / "rank00000.json").read_text())
    assert saved["data"]["drop"] == 10 and saved["data"]["batch_in_epoch"] == 110
    assert saved["components"]["rewind"]["used"] == 1
    assert saved["components"]["rewind"]["warmup_left"] == 5
    _, resumed, _ = _local_run(tmp_path / "a", "nan", knobs, at=100, length=12)
    _, straight, _ = _local_run(tmp_path / "b", "nan", knobs, at=100, length=12)
    for k, v in straight.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k


def test_the_report_reads_a_run_whose_step_numbers_repeat(tmp_path):
    _local_run(tmp_path, "nan", KNOBS, steps=120, at=60, length=12)
    assert len(_kinds(tmp_path, "rewind")) == 1
    rows = guardrails.read_metrics(tmp_path).column("step").to_pylist()
    assert rows.count(61) == 2  # the step left behind and the one trained after it
    report = subprocess.run(
        [sys.executable, "-m", "guardrails", "report", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    assert "rewound from step 70 to step 60" in report.stdout, report.stdout


def _once(at, damage):
    """A hook for ``_local_run``: ``damage(opt, "before" | "after")`` around the update of
    step ``at``, the first time only (step numbers repeat after a rewind)."""
    state = {"left": 1, "on": False}

    def hook(g, opt, when):
        if when == "before" and g.step + 1 == at and state["left"]:
            state["left"], state["on"] = 0, True
        if state["on"]:
            damage(opt, when)
            state["on"] = when == "before"

    return hook


def _lr_jump(factor):
    def jump(opt, when):
        for group in opt.param_groups:
            group["lr"] = group["lr"] * factor if when == "before" else group["lr"] / factor

    return jump


@pytest.mark.slow(reason="four 80-step runs in this process (~5 s on 2 busy cores)")
def test_damage_in_a_snapshot_steps_own_update_rewinds_to_an_older_snapshot(tmp_path):
    # Snapshots every 10 steps. The LR is raised 1000x for the update of step 40 alone: the
    # loss diverges from step 41, and the snapshot of step 40 holds that update already. The
    # rewind goes back to step 30 (before the LR jump), once, and the run recovers.
    nan = {"divergence_steps": 5, "check_every_n_steps": 5}
    rw = {"snapshot_every_steps": 10}
    _, _, clean = _local_run(tmp_path / "clean", "none", rw, steps=80, nan=nan)
    _, net, losses = _local_run(
        tmp_path / "jump40", "none", rw, steps=80, nan=nan, hook=_once(40, _lr_jump(1000))
    )
    (e,) = _kinds(tmp_path / "jump40", "rewind")
    assert (e["cause"], e["start"], e["to_step"]) == ("divergence", 40, 30), e
    assert e["trouble"]["lr_jump_step"] == 40 and "after an LR jump at step 40" in e["message"]
    assert e["batches_skipped"]["steps"] < 20
    assert all(torch.isfinite(p).all() for p in net.parameters())
    assert abs(_tail(losses, 10) - _tail(clean, 10)) < 0.15 * _tail(clean, 10), (losses, clean)
    # The same jump at a step that is no snapshot's (37): back to step 30, as before.
    _, _, losses = _local_run(
        tmp_path / "jump37", "none", rw, steps=80, nan=nan, hook=_once(37, _lr_jump(1000))
    )
    (e,) = _kinds(tmp_path / "jump37", "rewind")
    assert (e["start"], e["to_step"]) == (37, 30), e
    assert abs(_tail(losses, 10) - _tail(clean, 10)) < 0.15 * _tail(clean, 10)

    # Damage no signal shows before it (the weights knocked off right after step 40's
    # update): the first rewind lands on step 40's snapshot, sees the divergence again,
    # and goes further back (step 30) instead of repeating.
    def knock(opt, when):
        if when == "after":
            with torch.no_grad():
                for group in opt.param_groups:
                    for p in group["params"]:
                        p.add_(5.0)

    _, net, losses = _local_run(
        tmp_path / "knock", "none", rw, steps=80, nan=nan, hook=_once(40, knock)
    )
    events = _kinds(tmp_path / "knock", "rewind")
    assert [(e["start"], e["to_step"]) for e in events] == [(41, 40), (40, 30)], events
    assert all(torch.isfinite(p).all() for p in net.parameters())
    assert abs(_tail(losses, 10) - _tail(clean, 10)) < 0.15 * _tail(clean, 10), (losses, clean)


def test_a_snapshot_puts_a_grad_scalers_state_back_exactly(tmp_path):
    """A snapshot keeps a GradScaler's scale and growth tracker as the tensors the
    scaler holds (its state_dict() reads them on the host: a sync on a GPU at every
    snapshot step); a restore gives the scaler back exactly the state it had."""
    torch.manual_seed(0)
    net = rewind_worker.Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    data = rewind_worker.data(0, 8, "none", 0, 0)
    with guardrails.guard(
        net, opt, data, scaler=scaler, run_dir=tmp_path, progress=False, rewind=KNOBS
    ) as g:
        for i, (x, y) in enumerate(g):
            scaler.scale(net(x, y)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if i == 4:
                break
        rw = g.component("rewind")
        slot = min(rw._slots, key=lambda s: s.step)
        held = scaler.state_dict()
        assert held["_growth_tracker"] in (0, 1) and held["scale"] > 2.0**10  # it grew
        slot.take(g, (0, 0))
        scaler.update(new_scale=3.0)
        scaler._growth_tracker.fill_(7)
        slot.restore(g)
        assert scaler.state_dict() == held
