"""Runs that survive their own storage: a full, size-limited or read-only disk under a
real training process, real signals, real kills; and the write-side misuses.

How a disk fails here, without root:

* ``fsize``: ``setrlimit(RLIMIT_FSIZE, 0)`` in the training process (SIGXFSZ ignored),
  so every write to a file fails with EFBIG; the process can lift it again. Needs no
  privilege at all. (Its stdout and stderr are pipes: a file would refuse them too.)
* ``fill``: ``run_dir`` is a 4 MB tmpfs, filled to the last byte by a ballast file:
  ENOSPC, a real full disk. Mounted in a user namespace (``unshare -Urm``), which an
  unprivileged user may create where the kernel allows it; skipped, with the reason,
  where it does not.
* ``ro``: the same tmpfs, its directories bind-mounted read-only: EROFS.
* ``/dev/full`` linked as ``events.jsonl``: refused, no link in a run_dir is followed.
* a directory without write permission (chmod 0o555): root ignores modes, so as root
  the process runs without CAP_DAC_OVERRIDE (``setpriv``); skipped when neither works.

The script is tests/storage_worker.py; it prints a summary of what is on disk at its end
(a tmpfs in a user namespace is gone with the process).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _ranks import run_script
from conftest import Regressor, batches, events_path, patience, read_events, train_loop
from test_nan import poisoned, run_until_raise

import guardrails
from guardrails.checkpoint.common import CRASH_ENV
from guardrails.checkpoint.manifest import MANIFEST, _dumps, _self_hash, list_checkpoints
from guardrails.cli.inspect import inspect_dir

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parents[1] / "storage_worker.py"
TMPFS = 'mount -t tmpfs -o size=4m tmpfs "$1" && shift && exec "$@"'


def _userns_tmpfs(tmp_path: Path) -> str | None:
    """Why a tmpfs cannot be mounted here without root, or ``None`` when it can."""
    if shutil.which("unshare") is None:
        return "no unshare(1) here"
    probe = tmp_path / "probe"
    probe.mkdir()
    got = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", TMPFS, "sh", str(probe), "true"],
        capture_output=True,
        text=True,
    )
    if got.returncode != 0:
        return (
            "mounting a tmpfs needs a user namespace, which this kernel or container "
            f"refuses: {got.stderr.strip()}"
        )
    return None


def run_worker(run_dir: Path, *args: object, tmpfs: bool = False, env: dict | None = None):
    """The worker to its end: (exit code, stderr, summary or None)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(WORKER), str(run_dir), *map(str, args)]
    if tmpfs:
        reason = _userns_tmpfs(run_dir.parent)
        if reason:
            pytest.skip(reason)
        cmd = ["unshare", "-Urm", "sh", "-c", TMPFS, "sh", str(run_dir), *cmd]
    # Pipes, not files: under RLIMIT_FSIZE a file would refuse the output.
    got = run_script(cmd, timeout_s=240, env={**os.environ, **(env or {})})
    lines = [ln for ln in got.stdout.splitlines() if ln.startswith("summary: ")]
    summary = json.loads(lines[-1].removeprefix("summary: ")) if lines else None
    return got.returncode, got.stderr, summary


def steps(*names: str) -> list[str]:
    return [f"step_{int(n):09d}" for n in names]


# ------------------------------------------------------------------ mid-run failures


@pytest.mark.slow(reason="a real training process per disk")
@pytest.mark.parametrize("how", ["fsize", "fill", "ro"])
def test_a_disk_that_fails_mid_run_costs_warnings_not_the_run(tmp_path, how):
    # Saves every 5 steps, a metrics part every 2; the disk fails after step 12 and
    # heals after step 28. Before: the first parquet part after step 12 raised its
    # OSError out of the training loop (the run ended at step 13-14).
    run_dir = tmp_path / "run"
    rc, err, s = run_worker(
        run_dir, "--fail", how, "--fail-at", 12, "--heal-at", 28, tmpfs=how != "fsize"
    )
    assert rc == 0, err
    assert "Traceback" not in err, err
    assert s["step"] == 40 and s["error"] is None
    # Training went on through the failed saves of steps 15, 20 and 25; the previous
    # checkpoint stayed the latest and nothing half-written was left.
    assert s["committed"] == steps(5, 10, 30, 35, 40)
    assert s["entries"] == s["committed"]
    assert s["resumed_step"] == 40
    failed = [e for e in s["events"] if e["kind"] == "checkpoint_failed"]
    assert [e["step"] for e in failed] == [15, 20, 25]
    assert [e["level"] for e in failed] == ["warning", "info", "info"]  # said once
    assert "step_000000010 (step 10)" in failed[0]["message"]
    cause, fix = {
        "fsize": ("file size limit", "ulimit -f"),
        "fill": ("is full", "free space"),
        "ro": ("read-only file system", "remount it read-write"),
    }[how]
    assert cause in failed[0]["message"] and fix in failed[0]["message"]
    assert "another disk" in failed[0]["message"]  # the other way out: another run_dir
    assert err.count("checkpoint_failed") == 1, err
    # Every metric row survived: kept in memory, written by the first part after.
    assert s["metric_steps"] == list(range(1, 41))
    assert s["metric_leftovers"] == []
    # One warning for 8 failed parts, and one line when they went through again.
    assert err.count("could not write metrics") == 1, err
    assert err.count("still cannot write") == 0, err
    assert "metrics.parquet written again after 8 failed write(s); nothing was lost" in err
    if how == "fsize":  # events.jsonl failed too: kept, then written in order
        assert err.count(f"{events_path(tmp_path / 'run').name} (") == 1, err
        kinds = [e["kind"] for e in s["events"]]
        assert kinds[0] == "start" and kinds[-1] == "end"
        assert [e["step"] for e in s["events"] if e["kind"] == "checkpoint"] == [
            5,
            10,
            30,
            35,
            40,
        ]


@pytest.mark.slow(reason="2 ranks")
def test_one_ranks_disk_failing_is_a_warning_on_every_rank_and_both_train_on(tmp_path):
    # Rank 1 cannot write its part of the saves of steps 15-25: rank 0 does not commit
    # them, and every rank says so and trains on, together.
    from _ranks import run_ranks

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cmd = [sys.executable, WORKER, run_dir, "--fail", "fsize", "--fail-at", 12]
    cmd += ["--heal-at", 28, "--fail-ranks", 1]
    cmd += ["--rank", "{rank}", "--world", "{world}", "--port", "{port}"]
    results = run_ranks(cmd, 2, out=tmp_path / "logs", timeout_s=240)
    assert [r.code for r in results] == [0, 0], [r.text for r in results]
    lines = [ln for ln in results[0].out.splitlines() if ln.startswith("summary: ")]
    s = json.loads(lines[-1].removeprefix("summary: "))
    assert s["step"] == 40
    assert s["committed"] == steps(5, 10, 30, 35, 40) and s["entries"] == s["committed"]
    failed = [e for e in s["events"] if e["kind"] == "checkpoint_failed"]
    assert sorted((e["rank"], e["step"]) for e in failed) == [
        (r, step) for r in (0, 1) for step in (15, 20, 25)
    ]
    said = next(e["message"] for e in failed if e["rank"] == 0)
    assert "rank 1 could not write its part" in said and "file size limit" in said
    assert "step_000000010 (step 10)" in said


@pytest.mark.slow(reason="a real training process")
def test_metric_rows_kept_while_the_disk_is_full_are_bounded_and_the_loss_is_said(tmp_path):
    rc, err, s = run_worker(
        tmp_path / "run",
        "--fail",
        "fsize",
        "--fail-at",
        12,
        "--heal-at",
        28,
        "--max-pending-rows",
        6,
    )
    assert rc == 0, err
    # Rows 13-28 failed (8 parts); 6 were kept at most: the 10 oldest were dropped.
    assert s["metric_steps"] == [*range(1, 13), *range(23, 41)]
    assert "2 metric rows kept in memory" in err  # the first failure, said once
    assert "written again after 8 failed write(s); 10 rows were dropped" in err


# ------------------------------------------------------------------ a full disk at start


def test_an_events_file_linked_to_a_full_device_is_refused_not_written_through(tmp_path):
    # This was the full disk at start (/dev/full linked as events.jsonl). Since issue 52
    # no link in a run_dir is followed: the run is refused before a write goes through
    # it. A disk full from the start still lets the guard start: fsize and ro below.
    (tmp_path / "events.jsonl").symlink_to("/dev/full")
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(guardrails.LaunchError) as caught:
        guardrails.guard(model, opt, batches(6), run_dir=tmp_path, progress=False).start()
    assert caught.value.check == "run_dir_link" and "/dev/full" in str(caught.value)


def test_events_kept_while_the_disk_fails_are_bounded_and_the_gap_is_recorded(tmp_path):
    # In a child: RLIMIT_FSIZE is per process, and pytest writes files of its own.
    script = textwrap.dedent(
        f"""
        import resource, signal, sys, logging
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from guardrails.metrics import events as _events
        _events.MAX_PENDING = 10
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        log = _events.EventLog(Path({str(tmp_path)!r}), rank=0)
        log.emit("before", step=0)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
        for i in range(30):
            log.emit("during", step=i, n=i)
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        log.emit("after", step=30)
        log.close()
        """
    )
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    events = read_events(tmp_path)
    kinds = [e["kind"] for e in events]
    # At most 10 kept, the newest (the one that went through among them): the 21
    # oldest were dropped, the rest written in order, then the gap recorded in the file
    # itself.
    assert kinds == ["before", *["during"] * 9, "after", "events_dropped"]
    assert [e["n"] for e in events if e["kind"] == "during"] == list(range(21, 30))
    assert events[-1]["dropped"] == 21 and events[-1]["level"] == "warning"
    assert got.stderr.count("could not write") == 1, got.stderr  # rate-limited
    assert "21 event(s) were dropped" in got.stderr


@pytest.mark.slow(reason="a real training process per disk")
@pytest.mark.parametrize("how", ["fsize", "ro"])
def test_a_disk_full_from_the_start_lets_the_guard_start_and_the_first_save_says_why(tmp_path, how):
    # Before: the guard could not start (its start event raised ENOSPC / EROFS). Now it
    # starts and trains; the first periodic save, with no checkpoint of this run to fall
    # back on, is the error (a run_dir that takes no checkpoint is a setup mistake).
    rc, err, s = run_worker(tmp_path / "run", "--fail", how, "--fail-at", 0, tmpfs=how == "ro")
    assert rc == 1, err
    assert s["step"] == 5 and s["error"].startswith("CheckpointError")
    assert "no checkpoint yet to fall back on" in s["error"]
    assert ("ulimit -f" if how == "fsize" else "read-only") in s["error"]
    assert s["committed"] == [] and s["entries"] == []
    assert "could not write" in err and events_path(tmp_path / "run").name in err  # said


# ------------------------------------------------------------------ the signal save


@pytest.mark.slow(reason="a real training process per disk")
@pytest.mark.parametrize("how", ["fsize", "fill"])
def test_a_signal_save_that_cannot_be_written_still_exits_143_and_names_the_latest(tmp_path, how):
    # Before: exit code 1 and a traceback from the signal save.
    rc, err, s = run_worker(
        tmp_path / "run",
        "--fail",
        how,
        "--fail-at",
        12,
        "--sigterm-at",
        12,
        tmpfs=how == "fill",
    )
    assert rc == 143, err
    assert "Traceback" not in err, err
    [stopped] = [ln for ln in err.splitlines() if "stopped:" in ln]
    assert "SIGTERM received" in stopped and "stopped at step 12" in stopped
    assert "nothing new was saved" in stopped
    assert "the latest checkpoint is " in stopped and "step_000000010 (step 10)" in stopped
    assert ("ulimit -f" if how == "fsize" else "free space") in stopped
    assert s["committed"] == steps(5, 10) and s["entries"] == s["committed"]
    assert s["resumed_step"] == 10


@pytest.mark.slow(reason="a real training process")
def test_a_stop_still_saves_after_the_background_save_before_it_failed(tmp_path):
    # The first periodic save (step 5, written in the background) fails on the disk; the
    # disk is back by step 6, when SIGTERM comes. The stop's save must still be tried:
    # before, the older save's failure was raised at that boundary ("no checkpoint yet
    # to fall back on") and the pre-emption exited 1 with nothing saved.
    rc, err, s = run_worker(
        tmp_path / "run",
        "--fail", "fsize", "--fail-at", 4, "--heal-at", 6, "--slow-step", 6,
        "--sigterm-at", 6, "--background",
    )  # fmt: skip
    assert rc == 143, err
    assert "Traceback" not in err, err
    assert s["committed"] == steps(6) and s["entries"] == s["committed"], err
    assert s["resumed_step"] == 6
    [stopped] = [ln for ln in err.splitlines() if "stopped:" in ln]
    assert "stopped at step 6 and saved" in stopped, stopped
    [failed] = [e for e in s["events"] if e["kind"] == "checkpoint_failed"]
    assert failed["step"] == 5, failed
    assert "could not be saved" in failed["message"]
    assert "The stop's save comes next" in failed["message"]


# ------------------------------------------------------------------ save_checkpoint


SAVE_TWICE = """
import json, os, resource, signal, sys
sys.path.insert(0, {root!r})
import torch, guardrails
from torch import nn
torch.manual_seed(0)
model = nn.Linear(4, 2)
if {odd_dtype}:  # a dtype guardrails' own writer does not know: safetensors writes it
    model.register_buffer("counts", torch.full((1 << 20,), 7, dtype=torch.uint32))  # 4 MiB
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(3, 4)).sum().backward(); opt.step()
root = {root_dir!r}
guardrails.save_checkpoint(root, 1, model=model, optimizer=opt)
if {how!r} == "fsize":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # Past every other file, so that the model's (written by safetensors) fails.
    limit = (1 << 20) if {odd_dtype} else 0
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
else:
    os.chmod(root, 0o555)
try:
    guardrails.save_checkpoint(root, 2, model=model, optimizer=opt)
    out = {{"raised": None}}
except Exception as e:
    out = {{"raised": type(e).__name__, "message": e.message, "hint": e.hint,
            "cause": type(e.__cause__).__name__}}
os.chmod(root, 0o755)
print(json.dumps(out))
"""


def _as_unprivileged() -> list[str] | None:
    """A prefix that runs a command where file modes apply: nothing for a user, for
    root ``setpriv`` without the capabilities that bypass them; ``None`` if neither."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        return None
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"]


@pytest.mark.parametrize(
    ("how", "odd_dtype"), [("fsize", False), ("fsize", True), ("chmod", False)]
)
@pytest.mark.slow(reason="a process per storage fault")
def test_save_checkpoint_storage_errors_are_checkpoint_errors_with_the_fix(
    tmp_path, how, odd_dtype
):
    # Before: a directory without write permission raised PermissionError (the temp dir
    # was made outside the try), a dtype safetensors writes itself raised its own
    # SafetensorError.
    prefix: list[str] | None = []
    if how == "chmod":
        prefix = _as_unprivileged()
        if prefix is None:
            pytest.skip("running as root without setpriv: root ignores a 0o555 directory")
    root = tmp_path / "ckpts"
    script = SAVE_TWICE.format(root=str(ROOT), root_dir=str(root), how=how, odd_dtype=odd_dtype)
    got = subprocess.run(
        [*prefix, sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=patience(120),
    )
    assert got.returncode == 0, got.stderr
    out = json.loads(got.stdout.splitlines()[-1])
    assert out["raised"] == "CheckpointError", out
    assert "could not write checkpoint" in out["message"] and "step_000000002" in out["message"]
    if how == "fsize":
        assert "file size limit" in out["message"] and "ulimit -f" in out["hint"]
        assert out["cause"] == ("SafetensorError" if odd_dtype else "OSError")
    else:
        assert "may not write" in out["message"] and "permissions" in out["hint"]
        assert out["cause"] == "PermissionError"
    assert "another directory" in out["hint"]
    assert "the latest checkpoint is still" in out["message"]
    assert "step_000000001 (step 1)" in out["message"]
    # The previous checkpoint is intact and loadable; nothing partial is left.
    assert sorted(p.name for p in root.iterdir()) == steps(1)
    model = torch.nn.Linear(4, 2)
    if odd_dtype:
        model.register_buffer("counts", torch.zeros(1 << 20, dtype=torch.uint32))
    assert guardrails.resume(root, model)["step"] == 1


# ------------------------------------------------------------------ a re-save, killed


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    """A run of 6 steps, keep_last=1: its one checkpoint, step 6."""
    run_dir = tmp_path_factory.mktemp("six") / "run"
    rc, err, s = run_worker(run_dir, "--steps", 6, "--every-n", 3, "--keep-last", 1)
    assert rc == 0 and s["committed"] == steps(6), err
    return run_dir


@pytest.mark.slow(reason="3 real processes per point, one of them SIGKILLed")
@pytest.mark.parametrize("point", ["resave:before", "resave:aside", "resave:swapped"])
def test_a_same_step_re_save_killed_at_any_point_leaves_that_step_loadable(
    tmp_path, six_steps, point
):
    # A resumed run saves the step it resumed again (here g.save_checkpoint() at once),
    # keep_last=1, and is SIGKILLed inside the commit: before its renames, between
    # them (the old copy aside, the new one not yet in: before, both copies sat under
    # names no reader picks, and the next run restarted at step 0 and deleted both),
    # or after them.
    run_dir = tmp_path / "run"
    shutil.copytree(six_steps, run_dir)
    ckpts = run_dir / "checkpoints"
    saved = (ckpts / "step_000000006" / "model.safetensors").read_bytes()
    rc, err, _ = run_worker(run_dir, "--resave", "--keep-last", 1, env={CRASH_ENV: point})
    assert rc == -9, err  # the real SIGKILL, at that point of the commit
    # resume() reads step 6, whichever copy holds it, without writing anything.
    torch.manual_seed(1)
    model = Regressor()
    assert guardrails.resume(ckpts, model)["step"] == 6
    from safetensors.torch import load

    for k, v in load(saved).items():
        assert torch.equal(model.state_dict()[k], v), k
    # The next run resumes step 6 (not 0), and keep_last=1 leaves one checkpoint and no
    # leftovers of the killed save.
    rc, err, s = run_worker(run_dir, "--steps", 9, "--every-n", 3, "--keep-last", 1)
    assert rc == 0, err
    last_start = max(i for i, e in enumerate(s["events"]) if e["kind"] == "start")
    this_run = s["events"][last_start:]
    assert [e["step"] for e in this_run if e["kind"] == "resumed"] == [6]
    assert s["entries"] == steps(9)


# ------------------------------------------------------------------ misuses


def test_save_checkpoint_without_a_model_is_refused_before_anything_is_written(tmp_path):
    # Before: it wrote a checkpoint resume() could not load.
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"needs the model .* could not be resumed"):
        guardrails.save_checkpoint(tmp_path / "c", 1, model=None, optimizer=opt)
    assert not (tmp_path / "c").exists()


def test_saving_a_model_on_the_meta_device_says_to_materialize_it_first(tmp_path):
    # Issue 52: g.save_checkpoint() gave torch's NotImplementedError ("Cannot copy out
    # of meta tensor") from deep in the staging.
    model = Regressor()
    model.register_buffer("table", torch.empty(4, device="meta"))  # never materialized
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guardrails.guard(model, opt, batches(2), run_dir=tmp_path / "run", progress=False) as g:
        with pytest.raises(guardrails.CheckpointError) as caught:
            g.save_checkpoint()  # before the first step: the loop never reads it
        assert "1 tensor(s) on the meta device (table)" in str(caught.value)
        assert "model.to_empty(device=...)" in caught.value.hint
    with torch.device("meta"):
        empty = Regressor()
    with pytest.raises(guardrails.CheckpointError, match="on the meta device"):
        guardrails.save_checkpoint(tmp_path / "c", 1, model=empty, optimizer=None)
    assert not list((tmp_path / "c").glob("step_*"))


def test_a_checkpoint_without_model_state_is_a_resume_error(tmp_path):
    # One written before save_checkpoint(model=None) was refused: its manifest lists
    # no model file.

    model = Regressor()
    ckpt = guardrails.save_checkpoint(tmp_path, 1, model=model, optimizer=None)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    del manifest["files"]["model.safetensors"]
    (ckpt / "model.safetensors").unlink()
    manifest.pop("manifest_sha256")
    manifest["manifest_sha256"] = _self_hash(manifest)
    (ckpt / MANIFEST).write_bytes(_dumps(manifest))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(guardrails.ResumeError, match="holds no model state"):
        guardrails.resume(tmp_path, model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_resuming_into_a_model_on_the_meta_device_is_refused_before_anything_changes(tmp_path):
    # Before: it "resumed" (step returned, no error) and loaded nothing.
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    model(*batches(1)[0]).backward()
    opt.step()
    sched.step()
    guardrails.save_checkpoint(tmp_path, 1, model=model, optimizer=opt, scheduler=sched)
    with torch.device("meta"):
        empty = Regressor()
    opt2 = torch.optim.AdamW(empty.parameters(), lr=0.5)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 3)
    sched_before = sched2.state_dict()
    rng = torch.get_rng_state()
    with pytest.raises(guardrails.ResumeError, match="meta device") as info:
        guardrails.resume(tmp_path, empty, opt2, scheduler=sched2)
    assert "to_empty" in info.value.hint and "Nothing was modified" in info.value.hint
    assert opt2.state_dict()["state"] == {} and opt2.param_groups[0]["lr"] == 0.5
    assert sched2.state_dict() == sched_before
    assert torch.equal(torch.get_rng_state(), rng)
    # Materialized, the same call loads it.
    empty.to_empty(device="cpu")
    assert guardrails.resume(tmp_path, empty, opt2, scheduler=sched2)["step"] == 1
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), empty.parameters(), strict=True)
    )


# ------------------------------------------------------------------ runs kept apart


def _train(run_dir, n, *, resume, every, keep_last=2):
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = {"every_n_steps": every, "keep_last": keep_last, "strict_cadence": True}
    with guardrails.guard(
        model, opt, batches(n), run_dir=run_dir, resume=resume, checkpoint=ck, progress=False
    ) as g:
        first = g.step
        train_loop(g, model, opt)
    return first, g.step


def test_a_fresh_run_beside_another_runs_checkpoints_is_kept_apart(tmp_path):
    ckpts = tmp_path / "checkpoints"
    # Run A: steps 4, 8, 12 saved, keep_last=2 keeps 8 and 12.
    assert _train(tmp_path, 12, resume="auto", every=4) == (0, 12)
    assert [p.name for _, p in list_checkpoints(ckpts)] == steps(8, 12)
    # Run B starts fresh beside them and saves 3 and 6. Before: keep_last=2 kept the
    # highest steps, A's 8 and 12, deleting B's own as they were written.
    assert _train(tmp_path, 6, resume=None, every=3) == (0, 6)
    assert [p.name for _, p in list_checkpoints(ckpts)] == steps(3, 6, 8, 12)
    # `inspect` answers as resume does: B's newest.
    assert inspect_dir(tmp_path)["resume_would_use"] == str(ckpts / "step_000000006")
    [warned] = [e for e in read_events(tmp_path) if e["kind"] == "fresh_run_beside_checkpoints"]
    assert "kept apart" in warned["message"] and "resume='" in warned["message"]
    # resume="auto" continues B, the run that saved last (before: A's step 12), and
    # retention counts B's checkpoints only: its 3 goes, A's 8 and 12 stay.
    assert _train(tmp_path, 9, resume="auto", every=3) == (6, 9)
    assert [p.name for _, p in list_checkpoints(ckpts)] == steps(6, 8, 9, 12)
    assert guardrails.resume(ckpts, Regressor())["step"] == 9
    runs = {
        p.name: json.loads((p / MANIFEST).read_text())["run"]["id"]
        for _, p in list_checkpoints(ckpts)
    }
    assert runs["step_000000006"] == runs["step_000000009"] != runs["step_000000012"]
    assert runs["step_000000008"] == runs["step_000000012"]


def _shift_clock(ckpt: Path, by_s: float) -> None:
    """As if ``ckpt`` was saved on a host whose clock was off by ``by_s``: its recorded
    time moved, the manifest re-sealed (its own checksum recomputed)."""
    m = json.loads((ckpt / MANIFEST).read_text())
    m["time"] += by_s
    if m.get("run", {}).get("finished_at") is not None:
        m["run"]["finished_at"] += by_s
    m["manifest_sha256"] = _self_hash(m)
    (ckpt / MANIFEST).write_bytes(_dumps(m))


def test_resume_auto_continues_the_run_that_saved_last_whatever_the_clocks_say(tmp_path):
    ckpts = tmp_path / "checkpoints"
    assert _train(tmp_path, 12, resume="auto", every=4) == (0, 12)  # run A: 8, 12
    assert _train(tmp_path, 6, resume=None, every=3) == (0, 6)  # run B, fresh: 3, 6
    # B ran on a host whose clock was an hour behind: its saves look older than A's.
    for step in (3, 6):
        _shift_clock(ckpts / f"step_{step:09d}", -3600)
    seqs = {
        p.name: json.loads((p / MANIFEST).read_text())["seq"] for _, p in list_checkpoints(ckpts)
    }
    # A saved 4 (retired since), 8, 12: 1-3; B then 3, 6: 4, 5.
    assert seqs == dict(zip(steps(3, 6, 8, 12), (4, 5, 2, 3), strict=True)), seqs
    # The save order, not the clock: B is the run that saved last (before: A's 12).
    assert inspect_dir(tmp_path)["resume_would_use"] == str(ckpts / "step_000000006")
    assert guardrails.resume(ckpts, Regressor())["step"] == 6
    assert _train(tmp_path, 9, resume="auto", every=3) == (6, 9)
    assert json.loads((ckpts / "step_000000009" / MANIFEST).read_text())["seq"] == 6
    # And the other way round: A's clock ahead by a day changes nothing either.
    for step in (8, 12):
        _shift_clock(ckpts / f"step_{step:09d}", 86400)
    assert guardrails.resume(ckpts, Regressor())["step"] == 9


def test_a_run_resumed_from_checkpoints_without_a_run_id_counts_them_as_its_own(tmp_path):
    # Checkpoints written before run ids (here by save_checkpoint, which writes none)
    # are the run a resume continues: retention still counts them.
    ckpts = tmp_path / "checkpoints"
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (1, 2, 3):
        guardrails.save_checkpoint(ckpts, step, model=model, optimizer=opt)
    assert _train(tmp_path, 2, resume="auto", every=1) == (3, 5)  # 2 batches: no position
    assert [p.name for _, p in list_checkpoints(ckpts)] == steps(4, 5)


def test_a_healthy_run_with_checkpoints_and_metrics_says_no_storage_warning(tmp_path, caplog):
    caplog.set_level("WARNING", logger="guardrails")
    assert _train(tmp_path, 8, resume="auto", every=2) == (0, 8)
    assert [r.getMessage() for r in caplog.records] == []
    assert not [e for e in read_events(tmp_path) if e["level"] == "warning"]


def test_a_nan_batch_that_cannot_be_saved_still_gets_its_diagnosis(tmp_path):
    """NanGuard saves a bad step's batch under run_dir/nonfinite/. Where that cannot be
    written (here a file stands where the directory goes: the OS refuses with
    ENOTDIR / EEXIST, as a full or read-only disk refuses with its own errno), the
    diagnosis still comes, naming the sample row, and says the batch was not saved and
    why; no half-written dump is left. Before, the OSError replaced the diagnosis."""
    (tmp_path / "nonfinite").write_text("not a directory")
    err, _ = run_until_raise(tmp_path, poisoned(8, 5, row=3))
    assert (err.cause, err.step, err.samples) == ("bad_data", 5, [3])
    assert err.batch_path is None
    assert "could not be saved under" in str(err) and "nonfinite" in str(err)
    assert (tmp_path / "nonfinite").read_text() == "not a directory"


def test_benchmark_table_on_a_failing_disk_is_still_reported(tmp_path):
    """benchmark=True writes its table to run_dir/benchmark.json; where that file cannot
    be written, the table still comes as the `benchmark` event (path None)."""
    (tmp_path / "benchmark.json").mkdir()  # a directory where the file goes: EISDIR
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guardrails.guard(
        model, opt, batches(8) * 30, run_dir=tmp_path, benchmark=True, progress=False
    ) as g:
        train_loop(g, model, opt)
    [bench] = [e for e in read_events(tmp_path) if e["kind"] == "benchmark"]
    assert bench["path"] is None and "overhead_pct" in bench
