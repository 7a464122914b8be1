"""SignalCheckpointer and resume="auto": real processes, real signals, real files.

The training script is tests/ckpt_worker.py (dropout, a shuffling sampler, AdamW, a
LambdaLR schedule; DDP over gloo with 2 ranks). "Exact" means bitwise: weights,
optimizer state, scheduler state and the RNG state at the last step of a run that was
stopped by SIGTERM and resumed equal those of a run that was never interrupted.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _loops import train_loop_signalled
from _ranks import base_env, launch, launch_torchrun, patience, run_ranks
from conftest import Regressor, batches, read_events, train_loop
from torch import Tensor, nn

import guardrails
from guardrails.checkpoint.manifest import _self_hash, list_checkpoints, problem
from guardrails.checkpoint.read import verify_checkpoint

WORKER = Path(__file__).resolve().parents[1] / "ckpt_worker.py"
ROOT = Path(__file__).resolve().parents[2]


def _cmd(run_dir, out, *args, world=1):
    cmd = [sys.executable, WORKER, run_dir, out, *args]
    if world > 1:
        cmd += ["--rank", "{rank}", "--world", "{world}", "--port", "{port}"]
    return cmd


def _run(run_dir, out, *args, world=1):
    """``world`` worker processes to their end: (exit code, output) per rank."""
    cmd = _cmd(run_dir, out, *args, world=world)
    results = run_ranks(cmd, world, out=f"{out}.logs", timeout_s=240)
    return [(r.code, r.out) for r in results]


def _load(out, rank):
    return torch.load(f"{out}.rank{rank}.pt", weights_only=False)


def _assert_same(a, b):
    assert a["step"] == b["step"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sa, sb = a["opt"]["state"], b["opt"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for name in sa[i]:
            assert torch.equal(sa[i][name], sb[i][name]), (i, name)
    assert a["sched"] == b["sched"]
    assert torch.equal(a["rng"], b["rng"])  # dropout and shuffling streams line up


@pytest.mark.slow(reason="3 runs: straight, stopped, resumed")
def test_sigterm_then_resume_is_bitwise_exact(tmp_path):
    [(rc, text)] = _run(tmp_path / "straight", tmp_path / "a", "--steps", 24)
    assert rc == 0, text
    stopped = tmp_path / "stopped"
    [(rc, text)] = _run(stopped, tmp_path / "b", "--steps", 24, "--sigterm-at", 5)
    # 128 + SIGTERM: "terminated by a signal", after a complete save at step 5.
    assert rc == 128 + signal.SIGTERM, text
    assert "stopped at step 5" in text and "run the same command" in text
    assert [p.name for p in (stopped / "checkpoints").iterdir()] == ["step_000000005"]
    ev = [e for e in read_events(stopped) if e["kind"] == "stopped"]
    assert ev and ev[0]["signal"] == "SIGTERM" and ev[0]["step"] == 5

    # The same command again: resume="auto" continues from step 5 (mid-epoch: 16
    # batches per pass) and runs past the epoch boundary to step 24.
    [(rc, text)] = _run(stopped, tmp_path / "b", "--steps", 24, "--sigterm-at", 5)
    assert rc == 0, text
    a, b = _load(tmp_path / "a", 0), _load(tmp_path / "b", 0)
    assert b["resumes"] == 1 and a["epoch"] == b["epoch"] == 1
    _assert_same(a, b)
    resumed = [e for e in read_events(stopped) if e["kind"] == "resumed"]
    assert resumed[0]["step"] == 5


@pytest.mark.slow(reason="3 runs of 2 ranks: straight, stopped, resumed")
def test_sigterm_to_one_rank_stops_both_at_the_same_step_and_resumes_exactly(tmp_path):
    results = _run(tmp_path / "straight", tmp_path / "a", "--steps", 30, world=2)
    assert [rc for rc, _ in results] == [0, 0], results
    stopped = tmp_path / "stopped"
    args = ("--steps", 30, "--sigterm-at", 11, "--kill-ranks", 1)
    results = _run(stopped, tmp_path / "b", *args, world=2)
    assert [rc for rc, _ in results] == [143, 143], results
    (_, t0), (_, t1) = results
    assert "SIGTERM received by another rank" in t0 and "received by this rank" in t1
    steps = {e["step"] for e in read_events(stopped) if e["kind"] == "stopped"}
    assert len(steps) == 1  # one agreed step, on both ranks
    [ckpt] = (stopped / "checkpoints").iterdir()
    names = sorted(p.name for p in ckpt.iterdir())
    assert {"rank00000.json", "rank00001.json", "rank00001.safetensors"} <= set(names)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["ranks"] == [0, 1]

    results = _run(stopped, tmp_path / "b", *args, world=2)
    assert [rc for rc, _ in results] == [0, 0], results
    for rank in (0, 1):
        _assert_same(_load(tmp_path / "a", rank), _load(tmp_path / "b", rank))


@pytest.fixture(scope="module")
def fsdp_straight(tmp_path_factory):
    """The uninterrupted FSDP2 run both FSDP2 tests compare with: its output prefix."""
    tmp = tmp_path_factory.mktemp("fsdp_straight")
    results = _run(tmp / "straight", tmp / "a", "--steps", 24, "--fsdp", world=2)
    assert [rc for rc, _ in results] == [0, 0], results
    return tmp / "a"


@pytest.mark.slow(reason="2 runs of 2 FSDP2 ranks, and the shared straight run")
def test_fsdp2_sharded_state_goes_through_dcp_and_resumes_exactly(tmp_path, fsdp_straight):
    """FSDP2 (fully_shard on a CPU mesh, gloo): each rank writes its own shards with
    torch.distributed.checkpoint, listed and checksummed in the one manifest; the
    resumed run's full weights and optimizer state equal the uninterrupted run's."""
    stopped = tmp_path / "stopped"
    args = ("--steps", 24, "--sigterm-at", 9, "--kill-ranks", 0, "--fsdp")
    results = _run(stopped, tmp_path / "b", *args, world=2)
    assert [rc for rc, _ in results] == [143, 143], results
    [ckpt] = (stopped / "checkpoints").iterdir()
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(files)
    assert "model.safetensors" not in files  # never gathered to one rank
    results = _run(stopped, tmp_path / "b", *args, world=2)
    assert [rc for rc, _ in results] == [0, 0], results
    for rank in (0, 1):
        _assert_same(_load(fsdp_straight, rank), _load(tmp_path / "b", rank))
    # The load's own zero-grad optimizer step (torch's set_state_dict creating the
    # state) is not a training step: no "zero_grads" warning, no extra step.
    assert not [e for e in read_events(stopped) if e["kind"] == "zero_grads"]


@pytest.mark.slow(reason="2 runs of 2 FSDP2 ranks, and the shared straight run")
def test_fsdp2_background_saves_are_written_by_dcp_off_the_main_thread_and_resume_exactly(
    tmp_path, fsdp_straight
):
    """Periodic sharded saves in the background: the shards are staged in the main
    thread, and the writer thread writes them in DCP's format and commits them. A crash
    (no signal save) at step 14, then the same command: it resumes from a
    background-written checkpoint, bitwise."""
    crashed = tmp_path / "crashed"
    args = ("--steps", 24, "--every-n", 4, "--background", "--fsdp")
    results = _run(crashed, tmp_path / "b", *args, "--crash-at", 14, world=2)
    assert [rc for rc, _ in results] == [3, 3], results
    saves = [e for e in read_events(crashed) if e["kind"] == "checkpoint"]
    assert saves and all(e["background"] and e["sharded"] for e in saves), saves
    assert {e["step"] for e in saves} <= {4, 8, 12}, saves
    newest = max((crashed / "checkpoints").glob("step_*"))
    files = json.loads((newest / "manifest.json").read_text())["files"]
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(files)
    results = _run(crashed, tmp_path / "b", *args, world=2)
    assert [rc for rc, _ in results] == [0, 0], results
    for rank in (0, 1):
        _assert_same(_load(fsdp_straight, rank), _load(tmp_path / "b", rank))


@pytest.mark.slow(reason="2 runs of 2 FSDP2 ranks, and the shared straight run")
def test_fsdp2_stop_abandons_a_background_save_still_being_written(tmp_path, fsdp_straight):
    """A SIGTERM while an older FSDP2 background save is still being written (each item
    made 0.3 s slow, as a big model's write is): the stop does not wait for it. Its
    write ends at the item in progress, it is never committed (a
    ``checkpoint_abandoned`` event says so), the stop's own save is the checkpoint, and
    the run resumes from it bitwise."""
    stopped = tmp_path / "stopped"
    args = ("--steps", 24, "--every-n", 4, "--background", "--fsdp", "--slow-dcp-writes")
    results = _run(stopped, tmp_path / "b", *args, "--sigterm-at", 6, world=2)
    assert [rc for rc, _ in results] == [143, 143], results
    events = read_events(stopped)
    abandoned = [e for e in events if e["kind"] == "checkpoint_abandoned"]
    assert {e["rank"] for e in abandoned} == {0, 1}, events
    assert {e["step"] for e in abandoned} == {4}, abandoned
    assert "supersedes" in abandoned[0]["message"]
    # Only the stop's save: step 4's is in the trash, for the next start to delete.
    [ckpt] = (stopped / "checkpoints").glob("step_*")
    assert int(ckpt.name.split("_")[1]) > 4
    results = _run(stopped, tmp_path / "b", "--steps", 24, "--fsdp", world=2)
    assert [rc for rc, _ in results] == [0, 0], results
    for rank in (0, 1):
        _assert_same(_load(fsdp_straight, rank), _load(tmp_path / "b", rank))


@pytest.mark.slow(reason="7 processes, 6 of them SIGKILLed mid-save")
def test_sigkill_during_background_saves_always_leaves_a_loadable_checkpoint(tmp_path):
    rng = random.Random(4)
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    step = 0
    for trial in range(6):
        cmd = _cmd(run_dir, tmp_path / "x", "--steps", 100000, "--every-n", 3, "--background")
        with launch(cmd, 1, out=tmp_path / f"trial{trial}") as job:  # killed if it fails
            [p] = job.procs
            # Startup (importing torch) takes 1-3 s on a loaded 2-core machine: wait for
            # this trial's first commit, then kill at a random moment among the next saves
            # (one every 3 steps, a few ms per step).
            before = set(ckpts.glob("step_*"))
            deadline = time.monotonic() + patience(60)
            while not set(ckpts.glob("step_*")) - before:
                assert p.poll() is None and time.monotonic() < deadline, "no save committed"
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 1.0))
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=patience(60))
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
        )
        out = guardrails.resume(ckpts, model)
        assert out["step"] % 3 == 0 and out["step"] >= step, (trial, out, step)
        step = out["step"]
        # keep_last=3, plus at most one more: a kill that lands between a new
        # checkpoint's commit (rename) and the retirement of the oldest leaves four,
        # by design (the oldest is never retired before its successor is committed).
        assert len(list(ckpts.glob("step_*"))) <= 4, (trial, sorted(ckpts.iterdir()))
    # The next clean run resumes from the newest, finishes, and leaves exactly
    # keep_last checkpoints and no temp or trash directories of the killed saves.
    [(rc, text)] = _run(run_dir, tmp_path / "x", "--steps", step + 6, "--every-n", 3)
    assert rc == 0, text
    assert sorted(p.name for p in ckpts.iterdir()) == [
        f"step_{s:09d}" for s in (step, step + 3, step + 6)
    ]


@pytest.mark.slow(reason="a process importing torch, interrupted twice")
def test_second_ctrl_c_exits_at_once_without_a_checkpoint(tmp_path):
    # "At once": within 15 s on an idle machine (patience stretches it on a busy one),
    # and well before the slow loader's first batch, which comes at twice that.
    limit = patience(15)
    script = (
        "import time, torch, guardrails\n"
        "m = torch.nn.Linear(2, 1); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "def data():\n"
        "    while True:\n"
        f"        time.sleep({2 * limit}); yield torch.ones(1, 2)\n"  # a very slow loader
        f"with guardrails.guard(m, o, data(), run_dir={str(tmp_path)!r}, progress=False) as g:\n"
        "    print('ready', flush=True)\n"
        "    for x in g:\n"
        "        m(x).sum().backward(); o.step(); o.zero_grad()\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
    time.sleep(0.5)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)  # first: only a flag (the loader is still sleeping)
    time.sleep(0.5)
    assert p.poll() is None
    p.send_signal(signal.SIGINT)  # second: out now
    _, err = p.communicate(timeout=limit + 5)
    assert time.monotonic() - t0 < limit  # well before the batch (2 * limit) arrives
    assert p.returncode != 0 and b"KeyboardInterrupt" in err
    assert not list((tmp_path / "checkpoints").glob("step_*"))


_SLOW_SAVE = """
import sys, time, torch, guardrails
m = torch.nn.Linear(2, 1); o = torch.optim.SGD(m.parameters(), lr=0.1)
def data():
    while True:
        time.sleep(0.01); yield torch.ones(1, 2)
with guardrails.guard(m, o, data(), run_dir=sys.argv[1], progress=False) as g:
    g.state["ballast"] = torch.randn(64 << 20)  # 256 MB: a save of seconds
    for i, x in enumerate(g):
        m(x).sum().backward(); o.step(); o.zero_grad()
        if i == 1:
            print("ready", flush=True)
"""


def _sigints_during_a_stops_save(run_dir: Path, sigints: int) -> tuple[int, str, bool]:
    """A run of ``_SLOW_SAVE`` stopped by SIGTERM, then ``sigints`` SIGINTs while the
    stop's save is being written: (exit code, stderr, whether the save's temp dir was
    still there as the last SIGINT went out)."""
    p = subprocess.Popen(
        [sys.executable, "-c", _SLOW_SAVE, str(run_dir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    ckpts = run_dir / "checkpoints"

    def saving() -> bool:  # a temp dir holds the save until its commit
        return ckpts.is_dir() and any(c.name.startswith(".tmp-") for c in ckpts.iterdir())

    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
        p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + patience(30)
        while not saving():
            assert p.poll() is None and time.monotonic() < deadline, "the stop's save never began"
            time.sleep(0.005)
        during = True
        for i in range(sigints):
            if i:
                time.sleep(0.02)  # two signals at once may arrive as one
            during = saving()
            p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=patience(60))
    finally:
        p.kill()
    return p.returncode, err.decode(), during


@pytest.mark.slow(reason="a process per case, stopped by real signals during a save of seconds")
@pytest.mark.parametrize("sigints", [1, 2])
def test_a_sigint_during_a_sigterm_stops_save_keeps_the_sigterms_exit_code(tmp_path, sigints):
    # The save of 256 MB can end before the last SIGINT goes out on a fast disk: such an
    # attempt tests nothing, and the case runs again (3 attempts at most).
    for attempt in range(3):
        run_dir = tmp_path / f"run{attempt}"
        code, text, during = _sigints_during_a_stops_save(run_dir, sigints)
        if during:
            break
    assert during, "the save ended before the last SIGINT in every attempt"
    ckpts = run_dir / "checkpoints"
    assert code == 143, text  # SIGTERM's, not SIGINT's 130
    assert "KeyboardInterrupt" not in text
    stopped = [e for e in read_events(run_dir) if e["kind"] == "stopped"]
    if sigints == 1:
        # The save went on and was committed; the message is SIGTERM's, naming the SIGINT.
        [e] = stopped
        assert e["signal"] == "SIGTERM" and e["saved"], e
        assert (
            "A SIGINT (Ctrl+C) came after the SIGTERM and did not change the exit code"
            in (e["message"])
        )
        assert [c.name for c in ckpts.glob("step_*")] == [Path(e["path"]).name]
    else:
        # Out at once, still as SIGTERM's stop; the interrupted save left nothing half-done.
        [end] = [e for e in read_events(run_dir) if e["kind"] == "end"]
        assert end["error"].startswith(
            "SIGTERM received; a second SIGINT (Ctrl+C) during the stop's save ended the "
            "process before the save finished"
        ), end
        assert not list(ckpts.glob("step_*"))


def test_handlers_restored_and_exit_on_signal_false_ends_the_loop(tmp_path):
    nums = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGCHLD)
    before = {s: signal.getsignal(s) for s in nums}
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guardrails.guard(
        model,
        opt,
        batches(10),
        run_dir=tmp_path,
        progress=False,
        checkpoint={"exit_on_signal": False},
    ) as g:
        assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]
        # SLURM's warning signal after step 3: no batch after it (each one is a step).
        train_loop_signalled(g, model, opt, after_step=3, signum=signal.SIGUSR1)
        # Children's deaths are held from the signal to the close (loader workers that
        # died of it must not raise inside a step).
        assert signal.getsignal(signal.SIGCHLD) != before[signal.SIGCHLD]
        for _ in g:  # a later pass ends at once too
            raise AssertionError("a stopped guard yielded a batch")
    assert g.step == 3 and "SIGUSR1" in (g.stopping or "")
    assert (tmp_path / "checkpoints" / "step_000000003" / "manifest.json").is_file()
    assert {s: signal.getsignal(s) for s in before} == before


def test_list_loader_resumes_by_fast_forward_with_state_and_warning(tmp_path):
    def run(stop_at=None):
        torch.manual_seed(0)
        model = Regressor()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        with guardrails.guard(
            model,
            opt,
            batches(10),
            run_dir=tmp_path,
            progress=False,
            checkpoint={"exit_on_signal": False},
        ) as g:
            g.state["best"] = g.state.get("best", 9.0) - 1.0
            train_loop_signalled(g, model, opt, after_step=stop_at)
        return model, g

    straight, g1 = run()  # saves nothing: no periodic saves, no signal
    run(stop_at=4)
    resumed, g = run()
    assert g.step == 10 and g.state["best"] == 7.0  # g.state saved and restored
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    # NanGuard's statistics span the restart: the same spike window as the first run.
    nan1, nan2 = (
        next(c for c in x.components if isinstance(c, guardrails.NanGuard)) for x in (g1, g)
    )
    assert list(nan1.history) == list(nan2.history) and len(nan2.history) == 10
    ff = [e for e in read_events(tmp_path) if e["kind"] == "data_fast_forward"]
    assert ff and ff[0]["batches"] == 4 and "StatefulDataLoader" in ff[0]["message"]


def test_periodic_saves_writer_error_and_grace_warning(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the checkpoint directory should be")
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bad = guardrails.SignalCheckpointer(every_n_steps=2, directory=blocker, resume=None)
    with pytest.raises(guardrails.CheckpointError, match="could not write checkpoint"):
        with guardrails.guard(
            model, opt, batches(6), run_dir=tmp_path, progress=False, components=[bad]
        ) as g:
            train_loop(g, model, opt)
    # Raised in the main thread at the first boundary after the writer failed (step 2's
    # save), or by the save at close: a save due while the writer still runs is skipped,
    # not waited for, so the error can surface a few (~1 ms) steps later.
    assert 3 <= g.step <= 6

    # strict_cadence: each save waits for the previous one (else a save due while the
    # last is still writing is skipped, and these steps take ~1 ms).
    ck = guardrails.SignalCheckpointer(
        every_n_steps=2, grace_s=1e-6, keep_last=2, strict_cadence=True
    )
    with guardrails.guard(
        model, opt, batches(7), run_dir=tmp_path / "ok", progress=False, components=[ck]
    ) as g:
        train_loop(g, model, opt)
    steps = sorted(p.name for p in (tmp_path / "ok" / "checkpoints").glob("step_*"))
    assert steps == ["step_000000006", "step_000000007"]  # every 2, the end, keep_last=2
    assert len(ck.save_times_s) == 4 and len(ck.blocking_times_s) == 4
    slow = [e for e in read_events(tmp_path / "ok") if e["kind"] == "checkpoint_slow"]
    assert len(slow) == 1 and "SIGKILL" in slow[0]["message"]


def test_resume_errors(tmp_path):
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # Explicit path with nothing there: an error, not a silent fresh start.
    with pytest.raises(guardrails.ResumeError, match="no checkpoint under"):
        guardrails.guard(model, opt, batches(1), run_dir=tmp_path, resume=tmp_path / "x").start()
    # "auto" with nothing saved: a fresh run.
    with guardrails.guard(model, opt, batches(2), run_dir=tmp_path, progress=False) as g:
        assert g.step == 0
        g.save_checkpoint()
    ckpt = tmp_path / "checkpoints" / "step_000000000"

    # Written by 2 ranks, resumed by 1: says what is and is not restorable.
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["world_size"] = 2
    manifest["manifest_sha256"] = _self_hash(manifest)  # as the other writer would
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(guardrails.ResumeError, match="written by 2 rank") as err:
        guardrails.resume(ckpt, model, opt)
    assert "Not restorable" in str(err.value) and "allow_world_size_change" in err.value.hint
    # The fix in guard()'s current spelling, and the way out for a different run (the
    # example's torchrun demo after its single-process one, in the same run_dir).
    assert 'checkpoint={"allow_world_size_change": True}' in err.value.hint
    assert "resume_allow_world_size_change" not in err.value.hint
    assert "another run_dir" in err.value.hint
    assert guardrails.resume(ckpt, model, opt, allow_world_size_change=True)["step"] == 0

    # Written by a newer guardrails: says which version to install.
    manifest.update(world_size=1, format_version=99, guardrails="9.9.9")
    manifest["manifest_sha256"] = _self_hash(manifest)  # as the other writer would
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(guardrails.ResumeError, match="format 99.*reads up to format 4") as err:
        guardrails.resume(ckpt, model, opt)
    assert "9.9.9" in err.value.hint
    manifest.update(format_version=2)
    manifest["manifest_sha256"] = _self_hash(manifest)  # as the other writer would
    (ckpt / "manifest.json").write_text(json.dumps(manifest))

    # Every checkpoint corrupt under resume="auto": an error that lists why.
    (ckpt / "model.safetensors").write_bytes(b"junk")
    with pytest.raises(guardrails.ResumeError, match="every checkpoint .* invalid") as err:
        guardrails.guard(model, opt, batches(1), run_dir=tmp_path, progress=False).start()
    assert "model.safetensors" in str(err.value) and "resume=None" in err.value.hint


def test_inspect_cli_lists_validity_and_contents(tmp_path, capsys):
    from guardrails.__main__ import main

    assert main(["inspect", str(tmp_path)]) == 2
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.AdamW(model.parameters())
    ck = guardrails.SignalCheckpointer(every_n_steps=2, strict_cadence=True)  # both saved
    with guardrails.guard(
        model, opt, batches(4), run_dir=tmp_path, progress=False, components=[ck]
    ) as g:
        g.state["best_val"] = 1.5
        train_loop(g, model, opt)
    capsys.readouterr()
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 checkpoint(s)" in out and "step_000000004" in out.splitlines()[-1]
    assert "optimizer" in out and "data position (epoch 0, batch 4, fast_forward)" in out
    assert "guard state (nan)" in out and "extras (best_val)" in out
    (tmp_path / "checkpoints" / "step_000000004" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "checkpoints" / "step_000000002" / "manifest.json").unlink()
    assert main(["inspect", str(tmp_path / "checkpoints")]) == 1
    out = capsys.readouterr().out
    assert out.count("INVALID") == 2 and "model.safetensors is truncated" in out
    assert "resume would fail" in out


class Heavy(nn.Module):
    """A tiny regressor carrying a 32 MB buffer: every save writes 32 MB (tens of ms
    with the fsync) while a step takes well under a millisecond."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Regressor()
        self.register_buffer("ballast", torch.zeros(8 << 20))

    def forward(self, x, y):
        return self.net(x, y)


def _train_saving_every_step(run_dir, n, **checkpoint):
    torch.manual_seed(0)
    model = Heavy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = guardrails.SignalCheckpointer(every_n_steps=1, keep_last=2, **checkpoint)
    with guardrails.guard(
        model, opt, batches(n), run_dir=run_dir, progress=False, components=[ck]
    ) as g:
        train_loop(g, model, opt)
    return g, ck, read_events(run_dir)


@pytest.mark.slow(reason="30 steps, a save due at each")
def test_a_save_due_while_the_last_is_still_writing_is_skipped_not_waited_for(tmp_path):
    g, ck, events = _train_saving_every_step(tmp_path / "skip", 30)
    skipped = [e for e in events if e["kind"] == "checkpoint_skipped"]
    saved = [e["step"] for e in events if e["kind"] == "checkpoint"]
    assert g.step == 30 and skipped and ck.skipped_saves == len(skipped)
    # Every step saved or skipped, never both, except the last: skipped at its boundary,
    # then saved at the close (the run's final state is always on disk).
    skipped_steps = [e["step"] for e in skipped]
    assert saved == sorted(set(saved)) and saved[-1] == 30
    assert set(saved) | set(skipped_steps) == set(range(1, 31))
    assert set(saved) & set(skipped_steps) <= {30}
    first, *rest = skipped
    assert first["level"] == "warning" and "still being written" in first["message"]
    assert "strict_cadence=True" in first["message"] and first["writing_step"] < first["step"]
    assert all(e["level"] == "info" for e in rest)
    # The save that was skipped never blocked: only staging did.
    assert len(ck.blocking_times_s) == len(saved)
    ckpts = sorted((tmp_path / "skip" / "checkpoints").glob("step_*"))
    assert ckpts[-1].name == "step_000000030"
    assert all(verify_checkpoint(c) is None for c in ckpts)

    g, ck, events = _train_saving_every_step(tmp_path / "strict", 12, strict_cadence=True)
    assert not [e for e in events if e["kind"] == "checkpoint_skipped"]
    assert [e["step"] for e in events if e["kind"] == "checkpoint"] == list(range(1, 13))


def test_a_signal_at_a_step_just_saved_commits_that_save_and_writes_nothing_again(tmp_path):
    """SIGTERM while the loader ends, after the last step's periodic save started: the
    stop at that step is already saved, so it is the checkpoint (a second save of the
    same step would spend the grace period and replace a complete copy)."""

    def loader():
        yield from batches(6)
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the loop is ending

    torch.manual_seed(0)
    model = Heavy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(SystemExit) as exit_info:
        with guardrails.guard(
            model,
            opt,
            loader(),
            run_dir=tmp_path,
            progress=False,
            checkpoint={"every_n_steps": 3, "strict_cadence": True},  # step 6 is saved
        ) as g:
            train_loop(g, model, opt)
    assert exit_info.value.code == 143 and g.step == 6
    events = read_events(tmp_path)
    assert [e["step"] for e in events if e["kind"] == "checkpoint"] == [3, 6]
    [stopped] = [e for e in events if e["kind"] == "stopped"]
    assert stopped["path"].endswith("step_000000006")
    assert verify_checkpoint(stopped["path"]) is None


@pytest.mark.slow(reason="2 ranks saving at every step")
def test_ranks_agree_to_skip_a_save_while_any_rank_is_still_writing(tmp_path):
    """A save is one commit of every rank's files: if rank 0 skipped while rank 1 saved,
    rank 1 would wait for files that never come. The ranks decide together."""
    args = ("--steps", 30, "--every-n", 1, "--background", "--ballast-mb", 32)
    results = _run(tmp_path / "run", tmp_path / "out", *args, world=2)
    assert [rc for rc, _ in results] == [0, 0], results
    events = read_events(tmp_path / "run")
    skipped = {
        r: [e["step"] for e in events if e["kind"] == "checkpoint_skipped" and e["rank"] == r]
        for r in (0, 1)
    }
    assert skipped[0] and skipped[0] == skipped[1]
    saved = [e["step"] for e in events if e["kind"] == "checkpoint" and e["rank"] == 0]
    assert saved[-1] == 30 and not set(saved[:-1]) & set(skipped[0])
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    assert ckpts[-1].name == "step_000000030"
    assert all(verify_checkpoint(c) is None for c in ckpts)


@pytest.mark.slow(reason="256 MB saves")
def test_a_stop_abandons_an_older_save_still_being_written_and_saves_its_own_step(tmp_path):
    """SIGTERM while the periodic save of step 2 is still being written (256 MB): the
    stop's save of step 3 supersedes it, so that write is abandoned instead of waited
    for (the grace period is for the newest state), and only step 3 is committed."""
    torch.manual_seed(0)
    model = Heavy()
    model.ballast = torch.zeros(64 << 20)  # 256 MB: a write of a good fraction of a second
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(SystemExit) as exit_info:
        with guardrails.guard(
            model,
            opt,
            batches(10),
            run_dir=tmp_path,
            progress=False,
            checkpoint={"every_n_steps": 2, "keep_last": 1},
        ) as g:
            train_loop_signalled(g, model, opt, after_step=3)
    assert exit_info.value.code == 143 and g.step == 3
    events = read_events(tmp_path)
    [abandoned] = [e for e in events if e["kind"] == "checkpoint_abandoned"]
    assert abandoned["step"] == 2 and "step 3 supersedes it" in abandoned["message"]
    assert [e["step"] for e in events if e["kind"] == "checkpoint"] == [3]
    ckpts = tmp_path / "checkpoints"
    # The abandoned write is in the trash at once (never a temp dir that looks like a
    # save in progress), deleted by the next start rather than in the grace period.
    *trash, last = sorted(p.name for p in ckpts.iterdir())
    assert last == "step_000000003" and trash and all(n.startswith(".trash-") for n in trash)
    assert verify_checkpoint(ckpts / "step_000000003") is None
    with guardrails.guard(
        model, opt, batches(10), run_dir=tmp_path, progress=False, checkpoint={"keep_last": 1}
    ) as g:
        train_loop(g, model, opt)
    assert [p.name for p in ckpts.iterdir() if p.name.startswith(".trash-")] == []


@pytest.mark.slow(reason="2 ranks, 256 MB saves")
def test_two_ranks_abandon_an_older_write_together_and_commit_the_stop(tmp_path):
    """The abandoned write is one commit of both ranks' files: rank 0 says so through
    the store, so rank 1 does not wait out the commit timeout for it."""
    args = ("--steps", 40, "--every-n", 2, "--background", "--ballast-mb", 256)
    args += ("--sigterm-at", 3, "--kill-ranks", "0,1")
    # Without rank 0's word, rank 1 would wait the 300 s commit timeout: _run's 240 s
    # limit would kill it, and its exit code would not be 143.
    results = _run(tmp_path / "run", tmp_path / "out", *args, world=2)
    assert [rc for rc, _ in results] == [143, 143], results
    events = read_events(tmp_path / "run")
    [stopped] = [e for e in events if e["kind"] == "stopped" and e["rank"] == 0]
    stop = int(stopped["path"].rsplit("_", 1)[1])
    assert stop >= 3 and any(e["kind"] == "checkpoint_abandoned" for e in events)
    ckpts = sorted((tmp_path / "run" / "checkpoints").iterdir())
    assert [p.name for p in ckpts][-1] == f"step_{stop:09d}"
    assert not [p for p in ckpts if p.name.startswith(".tmp")]
    assert verify_checkpoint(ckpts[-1]) is None


def test_a_signal_save_without_periodic_saves_stages_into_memory_allocated_ahead(tmp_path):
    """With only saves on signals on, the staging memory is allocated at start (the
    model's) and grown after the first step (the optimizer's state): a SIGTERM at step 2
    copies into it and allocates nothing, and the run resumes bitwise."""

    def run(stop_at=None):
        torch.manual_seed(0)
        model = Regressor()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        seen = {}
        with guardrails.guard(
            model,
            opt,
            batches(6),
            run_dir=tmp_path,
            progress=False,
            checkpoint={"exit_on_signal": False},
        ) as g:
            staging = g.component("checkpoint").writer.staging
            staging.wait()
            seen["at start"] = staging.nbytes
            # Not train_loop: the staging blocks read, then a SIGTERM, at `stop_at`.
            for x, y in g:
                model(x, y).backward()
                opt.step()
                opt.zero_grad()
                if g.step == stop_at:
                    staging.wait()
                    seen["before"] = [(id(b), b.data_ptr(), b.numel()) for b in staging.blocks]
                    os.kill(os.getpid(), signal.SIGTERM)
            seen["after"] = [(id(b), b.data_ptr(), b.numel()) for b in staging.blocks]
            seen["allocated in save"] = staging.allocated_in_save
        return model, opt, seen

    straight, _, _ = run()
    shutil.rmtree(tmp_path / "checkpoints", ignore_errors=True)
    stopped, opt, seen = run(stop_at=2)
    model_bytes = sum(t.numel() * t.element_size() for t in stopped.state_dict().values())
    state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    assert seen["at start"] >= model_bytes  # before any step, without a periodic save
    assert sum(n for _, _, n in seen["before"]) >= model_bytes + state_bytes
    assert seen["after"] == seen["before"] and seen["allocated in save"] == 0
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000000002"]
    [saved] = [e for e in read_events(tmp_path) if e["kind"] == "checkpoint"]
    assert saved["step"] == 2 and saved["stage_fresh_bytes"] == 0
    resumed, _, _ = run()
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_signal_save_before_the_staging_is_grown_waits_for_nothing_and_resumes_bitwise(
    tmp_path,
):
    """A SIGTERM in step 1 is saved at its boundary, before the staging memory grows for
    the optimizer's state (which appears in that step): the stop's save copies what the
    blocks allocated at start do not hold into plain memory instead of allocating (on a
    GPU, pinning: ~3 s of a 10 GB save at step 10 waited for it), the staging grows no
    more, and the checkpoint resumes bitwise."""

    def run(stop_at=None):
        torch.manual_seed(0)
        model = Regressor()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        seen = {}
        with guardrails.guard(
            model,
            opt,
            batches(6),
            run_dir=tmp_path,
            progress=False,
            checkpoint={"exit_on_signal": False},
        ) as g:
            staging = g.component("checkpoint").writer.staging
            for x, y in g:
                model(x, y).backward()
                opt.step()
                opt.zero_grad()
                if g.step == stop_at:
                    staging.wait()
                    seen["before"] = staging.nbytes
                    os.kill(os.getpid(), signal.SIGTERM)
            staging.wait()
            seen["after"] = staging.nbytes
            seen["allocated in save"] = staging.allocated_in_save
            seen["stopped"] = staging.stopped
        seen["closed"] = staging.nbytes  # a stop lets its memory go at the guard's end
        return model, opt, seen

    straight, _, _ = run()
    shutil.rmtree(tmp_path / "checkpoints", ignore_errors=True)
    _, opt, seen = run(stop_at=1)
    state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    assert seen["stopped"] and seen["allocated in save"] == 0
    assert seen["after"] == seen["before"]  # grown neither by the save nor after it
    assert seen["before"] > 0 and seen["closed"] == 0
    [saved] = [e for e in read_events(tmp_path) if e["kind"] == "checkpoint"]
    # Adam's step counts are host scalars (cloned, not staged): the moments went to
    # plain memory.
    assert saved["step"] == 1 and 0 < saved["stage_fresh_bytes"] <= state_bytes, saved
    resumed, _, _ = run()
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


# --- the loader's worker processes and the stop signals --------------------------------
# torchrun, SLURM and a terminal's Ctrl+C signal a rank's whole process group: its
# DataLoader workers get the SIGTERM / SIGINT too.


def _wait_for(path: Path, job_or_proc, what: str) -> None:
    """Until ``path`` exists (the worker's mark at a known step), the run still going."""
    deadline = time.monotonic() + patience(120)
    while not path.exists():
        ended = job_or_proc.poll()
        assert not ended, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"never reached {what}"
        time.sleep(0.05)


def _group_signal(run_dir: Path, out: Path, sig: int, *args) -> tuple[int, str]:
    """A single-process run of the worker in its own process group, sent ``sig`` to the
    whole group (as a terminal's Ctrl+C) once it marked its step: (exit code, output)."""
    cmd = [sys.executable, WORKER, run_dir, out, *map(str, args)]
    with open(f"{out}.log", "w") as log:
        p = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=base_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _wait_for(Path(f"{out}.mark"), p, "its mark")
            os.killpg(p.pid, sig)
            p.wait(timeout=patience(120))
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return p.returncode, Path(f"{out}.log").read_text()


@pytest.mark.slow(reason="torchrun and 2 ranks with 2 loader workers each, twice; a straight run")
def test_sigterm_to_torchrun_with_loader_workers_saves_and_resumes_exactly(tmp_path):
    """The user's shape: torchrun, 2 gloo ranks, DistributedSampler + set_epoch,
    DataLoader(num_workers=2), OneCycleLR passed as scheduler=; SIGTERM to torchrun's pid
    in epoch 2 (8 steps per epoch). torchrun signals each rank's process group, workers
    included: they must not die of it before the ranks stop and save."""
    args = ("--steps", 20, "--workers", 2, "--onecycle")
    straight = run_ranks(
        _cmd(tmp_path / "straight", tmp_path / "a", *args, world=2),
        2,
        out=tmp_path / "a.logs",
        timeout_s=240,
    )
    assert [r.code for r in straight] == [0, 0], [r.text[-2000:] for r in straight]
    run_dir, out = tmp_path / "stopped", tmp_path / "b"
    cmd = [WORKER, run_dir, out, *args, "--mark-at", 10]
    with launch_torchrun(cmd, 2, out=tmp_path / "tr1") as job:
        _wait_for(Path(f"{out}.mark"), job, "step 10")
        os.kill(job.procs[0].pid, signal.SIGTERM)
        [first] = job.wait(120)
    stopped = [e for e in read_events(run_dir) if e["kind"] == "stopped"]
    ends = [e for e in read_events(run_dir) if e["kind"] == "end"]
    assert len(stopped) == 2 and all(e["saved"] for e in stopped), (stopped, ends, first.text)
    assert all(e["signal"] == "SIGTERM" for e in stopped)
    [step] = {e["step"] for e in stopped}
    assert 10 <= step <= 16, step  # epoch 2: steps 9-16
    assert [e["error"].startswith("pre-empted by SIGTERM") for e in ends] == [True, True], ends
    assert "killed by signal" not in first.text, first.text
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step_{step:09d}"]
    # torchrun re-raises the SIGTERM it got as its own failure (torch's launcher exits 1
    # with "SignalException"), whatever its ranks did: the ranks' outcome is above.
    assert first.code != 0

    # The same command again: resumed from that step, bitwise the run never interrupted.
    with launch_torchrun(cmd, 2, out=tmp_path / "tr2") as job:
        [second] = job.wait(240)
    assert second.code == 0, second.text[-3000:]
    assert [e["step"] for e in read_events(run_dir) if e["kind"] == "resumed"] == [step, step]
    for rank in (0, 1):
        a, b = _load(tmp_path / "a", rank), _load(out, rank)
        assert b["resumes"] == 1 and b["init_fn_restored"] and b["init_fn_shielded"], b
        _assert_same(a, b)


@pytest.mark.slow(reason="a process with 2 loader workers, interrupted, then resumed")
def test_ctrl_c_to_the_process_group_with_loader_workers_saves_exits_130_and_resumes(tmp_path):
    """Ctrl+C in a terminal: SIGINT to the whole foreground process group, the loader's
    workers included, while the process waits for its next batch (a slow dataset): the
    workers must live on to hand it over, and the stop comes at the next step boundary."""
    run_dir, out = tmp_path / "run", tmp_path / "b"
    args = ("--steps", 12, "--workers", 2, "--slow-data", "--mark-at", 3)
    code, text = _group_signal(run_dir, out, signal.SIGINT, *args)
    assert code == 128 + signal.SIGINT, text
    [stopped] = [e for e in read_events(run_dir) if e["kind"] == "stopped"]
    assert stopped["signal"] == "SIGINT" and stopped["saved"], stopped
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step_{stopped['step']:09d}"]
    [(code, text)] = _run(run_dir, out, *args)
    assert code == 0, text
    b = _load(out, 0)
    assert b["step"] == 12 and b["resumes"] == 1 and b["init_fn_restored"], b
    assert b["init_fn_shielded"], b
    assert [e["step"] for e in read_events(run_dir) if e["kind"] == "resumed"] == [stopped["step"]]


@pytest.mark.slow(reason="torchrun and 2 ranks with 2 loader workers each, twice")
def test_workers_started_before_the_guard_dying_of_the_signal_is_still_the_stop(tmp_path):
    """Workers the guard could not shield (a persistent_workers iterator made before the
    guard) die of torchrun's SIGTERM while each rank waits for its next batch: each
    loader fails at the same step boundary, after the signal (on the fetch, or at the
    boundary after a step their deaths came in), and that is the stop: the ranks count
    each other in there, save it together and exit 143; the same command resumes it."""
    run_dir, out = tmp_path / "run", tmp_path / "b"
    args = ("--steps", 12, "--workers", 2, "--slow-data", "--early-iter", "--mark-at", 3)
    cmd = [WORKER, run_dir, out, *args]
    with launch_torchrun(cmd, 2, out=tmp_path / "tr1") as job:
        _wait_for(Path(f"{out}.mark"), job, "step 3")
        os.kill(job.procs[0].pid, signal.SIGTERM)
        [first] = job.wait(120)
    events = read_events(run_dir)
    stopped = [e for e in events if e["kind"] == "stopped"]
    saved = [e for e in events if e["kind"] == "failure_saved"]
    said = f"{stopped}\n{events[-8:]}\n{first.text[-6000:]}"
    # Before, on a loaded machine the deaths reached the ranks inside a step (even inside
    # optimizer.step(): nothing saved, "a re-run starts from scratch"), seen in CI.
    if len(stopped) == 2:
        assert all(e["saved"] for e in stopped) and not saved, said
        [step] = {e["step"] for e in stopped}
    else:
        # Seen twice in 17 runs (once in CI), under load: rank 0's next batch had come before
        # its workers died, so it was inside the next step's all-reduce while rank 1's
        # fetch failed; no stop at one boundary, but rank 1's failure save holds the
        # last step both finished, whole (rank 0's part from its copy).
        assert not stopped and [e["complete"] for e in saved] == [True], said
        step = saved[0]["step"]
    [ckpt] = (run_dir / "checkpoints").iterdir()
    assert ckpt.name == f"step_{step:09d}"
    assert json.loads((ckpt / "manifest.json").read_text())["ranks"] == [0, 1]
    with launch_torchrun(cmd, 2, out=tmp_path / "tr2") as job:
        [second] = job.wait(240)
    assert second.code == 0, second.text[-3000:]
    assert [e["step"] for e in read_events(run_dir) if e["kind"] == "resumed"] == [step, step]
    assert _load(out, 0)["step"] == _load(out, 1)["step"] == 12


@pytest.mark.slow(reason="a process with 2 loader workers")
def test_a_loader_that_died_inside_a_step_is_the_stop_at_the_steps_end(tmp_path):
    """Workers the guard could not shield (started before it) die of the group's SIGTERM
    while the rank is in step 3's loop body (it sleeps there a second). torch's SIGCHLD handler
    raised inside the step (even inside optimizer.step(): "NOTHING was saved; a re-run
    starts from scratch"); held from the signal on, the step finishes and its boundary is
    the stop: saved, exit 143, the message names the dead worker."""
    run_dir, out = tmp_path / "run", tmp_path / "b"
    args = ("--steps", 12, "--workers", 2, "--early-iter", "--mark-at", 3)
    code, text = _group_signal(run_dir, out, signal.SIGTERM, *args)
    assert code == 128 + signal.SIGTERM, text
    assert "NOTHING was saved" not in text and "starts from scratch" not in text, text[-6000:]
    events = read_events(run_dir)
    assert not [e for e in events if e["kind"] == "failure_saved"], text[-6000:]
    [stopped] = [e for e in events if e["kind"] == "stopped"]
    assert stopped["saved"] and stopped["step"] == 3, stopped
    said = "A DataLoader worker had died of the signal (RuntimeError: DataLoader worker"
    assert said in stopped["message"], stopped
    found = dict(list_checkpoints(run_dir / "checkpoints"))
    assert list(found) == [3] and problem(found[3]) is None


_INIT_RAN: list[int] = []


def _own_init(worker_id: int) -> None:
    _INIT_RAN.append(worker_id)  # in the worker process: its dataset reads it


class _WhoServes(torch.utils.data.Dataset):
    """Each item: the worker's pid, and whether the loader's own worker_init_fn ran."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Tensor:
        return torch.tensor([os.getpid(), len(_INIT_RAN)])


@pytest.mark.slow(reason="a forkserver DataLoader worker: it imports this module")
def test_loader_workers_ignore_the_stop_signals_and_the_init_fn_is_given_back(tmp_path):
    """The workers of the guard's loader live through SIGTERM, SIGINT and SIGUSR1 while
    the guard runs; its worker_init_fn is the loop's object again once it closes, and a
    persistent worker then ends at SIGTERM as a DataLoader worker does (its loader's
    shutdown, the interpreter's exit)."""
    from torch.utils.data import DataLoader

    # forkserver: the worker_init_fn travels pickled, as under spawn.
    loader = DataLoader(
        _WhoServes(),
        batch_size=2,
        num_workers=1,
        worker_init_fn=_own_init,
        persistent_workers=True,
        multiprocessing_context="forkserver",
    )
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = []
    with guardrails.guard(model, opt, loader, run_dir=tmp_path, progress=False) as g:
        wrapper = loader.worker_init_fn
        assert wrapper is not _own_init and wrapper.inner is _own_init
        for x in g:
            if not rows:  # the first batch: the worker gets what torchrun's killpg sends
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
                    os.kill(int(x[0, 0]), sig)
                    time.sleep(0.05)
            model(x.float()).sum().backward()
            opt.step()
            opt.zero_grad()
            rows.append(x)
    served = torch.cat(rows)
    assert len(served) == 8 and len(set(served[:, 0].tolist())) == 1  # one worker, alive
    assert served[:, 1].eq(1).all() and _INIT_RAN == []  # the own init ran, in the worker
    assert loader.worker_init_fn is _own_init  # the very object, once the guard closed
    [worker] = loader._iterator._workers  # persistent: still running
    assert worker.is_alive()
    os.kill(worker.pid, signal.SIGTERM)
    worker.join(timeout=patience(10))
    assert worker.exitcode == 0
