"""The failure save (issue 50, row 1): a run that ends on a failure saves the last
finished step, and ``resume="auto"`` continues from it bitwise. Real processes (a
single one, or 2 gloo ranks under DDP), real exceptions, a real hang, a real SIGKILL;
the resumed weights and optimizer state are compared bit for bit with an uninterrupted
run of the same worker (``tests/failsave_worker.py``)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
from _ranks import TESTS, run_ranks, run_script
from conftest import read_events

from guardrails.checkpoint.manifest import list_checkpoints, problem

WORKER = TESTS / "failsave_worker.py"
STEPS = 12


def worker(run_dir: Path, *args: object) -> list[str]:
    return [sys.executable, str(WORKER), "--run-dir", str(run_dir), "--steps", str(STEPS)] + [
        str(a) for a in args
    ]


def single(run_dir: Path, *args: object) -> str:
    """One process of the worker: its output (stdout + stderr)."""
    done = run_script(worker(run_dir, *args), timeout_s=60)
    return done.stdout + done.stderr


def events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_events(run_dir) if e.get("kind") == kind]


def manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / "manifest.json").read_text())


def assert_same_final(a: Path, b: Path, rank: int = 0, *, steps: int = STEPS) -> None:
    """The two runs ended with bitwise the same weights and optimizer state, RNG streams
    (torch's, python's, numpy's) and batches in the steps both trained."""
    x = torch.load(a / f"final{rank}.pt", weights_only=False)
    y = torch.load(b / f"final{rank}.pt", weights_only=False)
    assert x["step"] == y["step"] == steps
    for k in x["model"]:
        assert torch.equal(x["model"][k], y["model"][k]), k
    for i, s in x["opt"]["state"].items():
        for k, v in s.items():
            assert torch.equal(v, y["opt"]["state"][i][k]), (i, k)
    assert torch.equal(x["rng"][0], y["rng"][0]) and x["rng"][1] == y["rng"][1]
    assert (x["rng"][2] == y["rng"][2]).all()
    assert x["seen"] == {s: y["seen"][s] for s in x["seen"]}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The single-process run that never failed."""
    run_dir = tmp_path_factory.mktemp("clean")
    out = single(run_dir)
    assert (run_dir / "final0.pt").exists(), out
    return run_dir


def test_exception_in_the_loop_saves_the_last_finished_step(tmp_path, uninterrupted):
    """(1) The step after step 7 fails after its forward and backward (dropout and
    python's random drew, its batch was fetched): step 7 is saved with the RNG streams
    and data position of its boundary, and the resume is bitwise the clean run."""
    out = single(tmp_path, "--fault", "forward", "--at", 7)
    assert "boom after the backward" in out
    [(step, ckpt)] = list_checkpoints(tmp_path / "checkpoints")
    assert step == 7
    m = manifest(ckpt)
    assert m["failure"] == {
        "cause": "ValueError: boom after the backward",
        "state": "live",
        "missing": [],
    }
    assert problem(ckpt) is None
    [said] = events(tmp_path, "failure_saved")
    assert said["path"] == str(ckpt) and said["state"] == "live" and said["complete"]
    assert said["step"] == 7 and said["seconds"] < 10
    assert said["cause"] == "ValueError: boom after the backward"
    resumed = single(tmp_path)
    assert "resumed from" in resumed and "step 7" in resumed, resumed
    assert_same_final(tmp_path, uninterrupted)


def test_a_failure_after_a_prefetch_fetches_the_step_s_batch_again_on_resume(tmp_path):
    """nanoGPT's loop (its next batch fetched after the forward, the rows drawn from
    torch's RNG by a fast-forwarded loader) fails after the prefetch of the step after
    step 7: the save keeps the batch held at step 7's boundary and not the one the
    failing step fetched, which the resumed run fetches again from the boundary's
    streams. Handed out as saved instead, it skipped its draw, and the resumed run
    trained on other batches from step 10 on."""
    clean = tmp_path / "clean"
    done = single(clean, "--prefetch")
    assert (clean / "final0.pt").exists(), done[-3000:]
    out = single(tmp_path, "--prefetch", "--fault", "forward", "--at", 7)
    assert "boom after the prefetch" in out, out[-3000:]
    [(step, ckpt)] = list_checkpoints(tmp_path / "checkpoints")
    data = json.loads((ckpt / "rank00000.json").read_text())["data"]
    assert step == 7 and data["kind"] == "fast_forward" and len(data["held"]) == 1, data
    resumed = single(tmp_path, "--prefetch")
    assert "resumed from" in resumed and "step 7" in resumed, resumed
    assert_same_final(tmp_path, clean)


def test_failure_inside_optimizer_step_saves_nothing(tmp_path):
    """(2) An update that failed half-way: the live weights are neither step 7's nor
    step 8's, so nothing is saved, and the event says why."""
    out = single(tmp_path, "--fault", "instep", "--at", 7)
    assert "boom inside optimizer.step()" in out
    assert list_checkpoints(tmp_path / "checkpoints") == []
    [said] = events(tmp_path, "failure_saved")
    assert said["state"] == "none" and said["path"] is None
    assert "inside optimizer.step()" in said["why"]
    assert "nothing was saved" in out


def test_failure_after_the_update_saves_the_step_it_made(tmp_path, uninterrupted):
    """(8) An error after the update that made step 7 (the loop's logging): the live
    weights are step 7's, so step 7 is saved with the RNG streams and data position as
    they are then, said in the manifest (``state: after_update``), and the resume is
    bitwise the clean run."""
    out = single(tmp_path, "--fault", "after", "--at", 7)
    assert "boom after the update" in out
    [(step, ckpt)] = list_checkpoints(tmp_path / "checkpoints")
    assert step == 7
    assert manifest(ckpt)["failure"] == {
        "cause": "ValueError: boom after the update",
        "state": "after_update",
        "missing": [],
        "after_update": [0],
    }
    [said] = events(tmp_path, "failure_saved")
    assert said["state"] == "after_update" and said["complete"]
    assert "after the update of step 7" in said["message"]
    resumed = single(tmp_path)
    assert "resumed from" in resumed and "step 7" in resumed, resumed
    assert_same_final(tmp_path, uninterrupted)


def test_healthy_run_and_failure_at_start_save_nothing(tmp_path):
    """(6) A run that ends normally writes no failure save and no event; (7) a failure
    before the first step saves nothing (nothing trained)."""
    single(tmp_path / "healthy")
    assert list_checkpoints(tmp_path / "healthy" / "checkpoints") == []
    assert events(tmp_path / "healthy", "failure_saved") == []
    out = single(tmp_path / "start", "--fault", "start")
    assert "boom before the first step" in out
    assert list_checkpoints(tmp_path / "start" / "checkpoints") == []
    assert events(tmp_path / "start", "failure_saved") == []


def test_turned_off(tmp_path):
    """``checkpoint={"save_on_failure": False}``: the failure saves nothing."""
    import guardrails

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [torch.ones(1, 2)] * 4
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match="boom"):
        with guardrails.guard(
            model, opt, data, run_dir=tmp_path, checkpoint={"save_on_failure": False}
        ) as g:
            for x in g:
                if g.step == 2:
                    raise ValueError("boom")
                model(x).sum().backward()
                opt.step()
    torch.set_rng_state(state)
    assert list_checkpoints(tmp_path / "checkpoints") == []


def ddp(run_dir: Path, *args: object, timeout_s: float = 90) -> list:
    return run_ranks(worker(run_dir, *args), 2, out=run_dir / "out", timeout_s=timeout_s)


@pytest.fixture(scope="module")
def uninterrupted_ddp(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("clean_ddp")
    ranks = ddp(run_dir)
    assert all(r.code == 0 for r in ranks), [r.out for r in ranks]
    return run_dir


def test_hang_saves_from_the_watchdog_thread(tmp_path, uninterrupted_ddp):
    """(3) Rank 1 stuck in a sleep in the step after step 7, rank 0 blocked in DDP's
    all-reduce: both end from the watchdog's thread, and each writes its part from
    there (rank 1 its boundary's RNG streams and data position): step 7 is a complete
    checkpoint, and the resume is bitwise the clean run on both ranks."""
    t0 = time.monotonic()
    ranks = ddp(tmp_path, "--fault", "sleep", "--at", 7, "--rank", 1, "--hang-timeout-s", 3)
    assert all(r.code != 0 for r in ranks)
    [(step, ckpt)] = list_checkpoints(tmp_path / "checkpoints")
    assert step == 7, [r.out for r in ranks]
    m = manifest(ckpt)
    assert m["failure"]["missing"] == [] and m["ranks"] == [0, 1]
    assert problem(ckpt) is None
    assert time.monotonic() - t0 < 60
    ranks = ddp(tmp_path)
    assert all(r.code == 0 for r in ranks), [r.out for r in ranks]
    for rank in (0, 1):
        assert_same_final(tmp_path, uninterrupted_ddp, rank)


def test_a_stuck_rank_that_has_not_heard_is_written_from_its_copy_without_the_long_wait(
    tmp_path, uninterrupted_ddp
):
    """Rank 1 stuck in a sleep in the step after step 7; rank 0's gloo timeout (3 s) is
    shorter than the watchdog's (30 s), so rank 0 fails on its own and saves while rank
    1 has heard of nothing (it hears once rank 0 has ended). Rank 0 holds rank 1's copy
    (the same host): it writes rank 1's part from it after 2 s instead of waiting 10 s
    for rank 1 to begin. Step 7 is whole and the resume is bitwise the clean run.
    Rank 1 learns of rank 0's end from its exit (rank 0 hosted the store, on this host):
    within a few heartbeats, not after the store's 30 s."""
    args = ("--fault", "sleep", "--at", 7, "--rank", 1, "--hang-timeout-s", 30)
    ranks = ddp(tmp_path, *args, "--pg-timeout-s", 3)
    assert all(r.code != 0 for r in ranks)
    ended = {e["rank"]: e for e in events(tmp_path, "end")}
    [heard] = events(tmp_path, "rank_failed")
    assert heard["rank"] == 1 and heard["time"] - ended[0]["time"] < 10, (heard, ended)
    said = heard["message"]
    assert "rank 0 (it hosts the TCPStore) has exited at step 7 (" in said and "Timed out" in said
    [(step, ckpt)] = list_checkpoints(tmp_path / "checkpoints")
    assert step == 7, [r.out for r in ranks]
    failure = manifest(ckpt)["failure"]
    assert failure["missing"] == [] and failure["from_peers"] == [1], failure
    [said] = [e for e in events(tmp_path, "failure_saved") if e["rank"] == 0]
    waited_s = said["phases"]["gathered"] - said["phases"]["written"]
    assert 2.0 <= waited_s < 8.0, said["phases"]  # the wait for a copy held, not 10 s
    ranks = ddp(tmp_path)
    assert all(r.code == 0 for r in ranks), [r.out for r in ranks]
    for rank in (0, 1):
        assert_same_final(tmp_path, uninterrupted_ddp, rank)


def test_killed_rank_makes_an_incomplete_save_that_resume_skips(tmp_path, uninterrupted_ddp):
    """(4) Rank 1 SIGKILLed in the step after step 7 (periodic saves every 5 steps),
    its published part gone with it (as on another host: ``test_peer_save.py`` has the
    same host): rank 0 writes step 7 without rank 1's files, marked incomplete;
    resume='auto' takes step 5, says why it skipped step 7, and ends bitwise the clean
    run. (5) The save does not wait out its limit (15 s here) for a rank that never
    began to write: 10 s."""
    args = ("--fault", "kill_unpublished", "--at", 7, "--rank", 1, "--every", 5)
    args += ("--hang-timeout-s", 3)
    ranks = ddp(tmp_path, *args, "--save-timeout-s", 15)
    assert ranks[1].code == -9
    found = dict(list_checkpoints(tmp_path / "checkpoints"))
    assert sorted(found) == [5, 7], [r.out for r in ranks]
    m = manifest(found[7])
    assert m["failure"]["missing"] == [1] and m["ranks"] == [0]
    assert "incomplete failure save" in problem(found[7])[1]
    [said] = events(tmp_path, "failure_saved")
    assert not said["complete"] and said["missing"] == [1]
    assert "rank 1: its published copy is not on this host" in said["message"]
    shown = run_script(
        [sys.executable, "-m", "guardrails", "inspect", tmp_path / "checkpoints"], timeout_s=30
    ).stdout
    assert "step_000000007 is an incomplete failure save" in shown and "rank(s) [1]" in shown
    assert said["seconds"] < 10 + 3  # gather.py's BEGUN_WAIT_S, and the commit
    ranks = ddp(tmp_path)
    assert all(r.code == 0 for r in ranks), [r.out for r in ranks]
    assert "skipped checkpoint step_000000007" in ranks[0].out
    assert "incomplete failure save" in ranks[0].out
    for rank in (0, 1):
        assert_same_final(tmp_path, uninterrupted_ddp, rank)


def test_only_an_incomplete_save_means_a_fresh_start_not_an_invalid_directory(
    tmp_path, uninterrupted_ddp
):
    """Rank 1 SIGKILLed with no periodic saves, its published part gone with it: the only
    checkpoint is rank 0's incomplete failure save. The re-run (a requeue, or torchrun's
    restart) starts from step 0 with a warning that says why, instead of refusing the
    directory as all invalid, and ends bitwise the clean run."""
    args = ("--fault", "kill_unpublished", "--at", 7, "--rank", 1, "--hang-timeout-s", 3)
    ranks = ddp(tmp_path, *args, "--save-timeout-s", 15)
    assert ranks[1].code == -9
    [(step, ckpt)] = list_checkpoints(tmp_path / "checkpoints")
    assert step == 7 and manifest(ckpt)["failure"]["missing"] == [1]
    ranks = ddp(tmp_path)
    assert all(r.code == 0 for r in ranks), [r.out for r in ranks]
    [said] = events(tmp_path, "resume_skipped_incomplete")
    assert "incomplete failure saves" in said["message"] and "step 0" in said["message"]
    assert said["paths"] == [str(ckpt)]
    for rank in (0, 1):
        assert_same_final(tmp_path, uninterrupted_ddp, rank)


def test_error_on_one_rank_is_saved_whole(tmp_path, uninterrupted_ddp):
    """A bad batch on rank 1 only: rank 1 writes its part and leaves (rank 0, waiting
    for it in DDP's all-reduce, has not begun); rank 0's collective then fails, and it
    commits step 7 with rank 1's part: complete, and the resume is bitwise."""
    ranks = ddp(tmp_path, "--fault", "raise", "--at", 7, "--rank", 1)
    assert "boom: a bad batch" in ranks[1].out
    [(step, ckpt)] = list_checkpoints(tmp_path / "checkpoints")
    assert step == 7, [r.out for r in ranks]
    assert manifest(ckpt)["failure"]["missing"] == []
    assert "this rank wrote its part" in ranks[1].out
    ranks = ddp(tmp_path)
    assert all(r.code == 0 for r in ranks), [r.out for r in ranks]
    for rank in (0, 1):
        assert_same_final(tmp_path, uninterrupted_ddp, rank)


@pytest.mark.slow(reason="2 ranks, 170 steps, three times: clean, a hang, the resume")
def test_hang_after_the_update_saves_the_step_it_made(tmp_path, tmp_path_factory):
    """Rank 1 stuck in a sleep after the update that made step 150 (a logging
    all-reduce, an eval), rank 0 past step 150's boundary, blocked in step 151's
    all-reduce: the hang's verdict, and both save step 150: rank 1 from the watchdog's
    thread with its streams and position as they are after the update (nothing drew
    since), rank 0 with its boundary's. The save is whole, says ``after_update: [1]``,
    and the resume ends bitwise the uninterrupted run on both ranks: weights, optimizer
    state, RNG streams, and the batch of every step after 150 (with 2 ranks DDP's sums
    are the same in any order: ``test_peer_save.py`` says why 4 are not)."""
    steps = 170
    clean = tmp_path_factory.mktemp("clean_170")
    assert all(r.code == 0 for r in ddp(clean, "--steps", steps))
    ranks = ddp(
        tmp_path, "--steps", steps, "--fault", "sleep_after", "--at", 150, "--rank", 1,
        "--hang-timeout-s", 3,
    )  # fmt: skip
    assert all(r.code != 0 for r in ranks)
    [(step, ckpt)] = list_checkpoints(tmp_path / "checkpoints")
    assert step == 150, [r.out for r in ranks]
    failure = manifest(ckpt)["failure"]
    assert failure["state"] == "after_update" and failure["after_update"] == [1], failure
    assert failure["missing"] == [] and problem(ckpt) is None
    ranks = ddp(tmp_path, "--steps", steps)
    assert all(r.code == 0 for r in ranks), [r.out for r in ranks]
    assert "resumed from" in ranks[0].out and "(step 150," in ranks[0].out
    for rank in (0, 1):
        assert_same_final(tmp_path, clean, rank, steps=steps)
