"""A dead rank's part of a failure save, written by a live rank from the copy the dead
rank published at every step boundary (``guards/checkpointer/peer.py``; issue 50: a peer's
death under DDP must not cost the steps since the last checkpoint). Real jobs (gloo, DDP:
each rank its own process, or under torchrun ``--nnodes 1``, in the slow tier), a real
SIGKILL mid-run with periodic saves every 50 steps:
the survivors' save is whole, ``resume="auto"`` continues from it, redoing no step, and
every rank ends bitwise the uninterrupted run: weights, optimizer state, RNG streams, and
the batch of every step trained after the resume."""

from __future__ import annotations

import json
import os
import random
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from _ranks import TESTS, run_ranks, torchrun
from conftest import read_events
from safetensors.torch import load_file

from guardrails.checkpoint.manifest import list_checkpoints, problem

WORKER = TESTS / "failsave_worker.py"
STEPS, EVERY, AT = 80, 50, 67


def args(run_dir: Path, *more: object) -> list[str]:
    return [str(WORKER), "--run-dir", str(run_dir), "--steps", str(STEPS)] + [str(a) for a in more]


def final(run_dir: Path, rank: int) -> dict:
    return torch.load(run_dir / f"final{rank}.pt", weights_only=False)


def assert_same_checkpoint(a: Path, b: Path, world: int) -> None:
    """Two checkpoints of the same step hold bitwise the same weights and optimizer
    state, and every rank's RNG streams and data position."""
    for name in ("model.safetensors", "optimizer.safetensors"):
        x, y = load_file(a / name), load_file(b / name)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name
    for rank in range(world):
        x, y = (json.loads((c / f"rank{rank:05d}.json").read_text()) for c in (a, b))
        assert (x["rng"], x["data"], x["step"]) == (y["rng"], y["data"], y["step"]), rank
        x, y = (load_file(c / f"rank{rank:05d}.safetensors") for c in (a, b))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), rank


def assert_same_end(run: Path, clean: Path, world: int, *, since: int) -> None:
    """Every rank of ``run`` ended as ``clean``'s did: torch's and python's RNG streams
    bitwise, the same batch at every step after ``since`` (the data position each rank
    resumed at), and the same weights and optimizer state, bitwise: at 4 ranks too, where
    the resume gives DDP the saved buckets back (rank 0's part written from its copy
    carries them: without them its first step sums in other buckets, other bits)."""
    for rank in range(world):
        x, y = final(run, rank), final(clean, rank)
        assert x["step"] == y["step"] == STEPS
        same = torch.equal
        for k in x["model"]:
            assert same(x["model"][k], y["model"][k]), (rank, k)
        for i, s in x["opt"]["state"].items():
            for k, v in s.items():
                assert same(v, y["opt"]["state"][i][k]), (rank, i, k)
        assert torch.equal(x["rng"][0], y["rng"][0]) and x["rng"][1] == y["rng"][1], rank
        assert (x["rng"][2] == y["rng"][2]).all(), rank
        assert sorted(x["seen"]) == list(range(since + 1, STEPS + 1)), rank
        assert x["seen"] == {s: y["seen"][s] for s in x["seen"]}, rank


def assert_resumed_whole(run: Path, clean: Path, world: int, saved: Path, *more: str) -> None:
    """``saved`` (step AT) is whole and bitwise ``clean``'s save of that step; the same
    command again (``world`` ranks, each its own process) resumes it, redoing no step, and ends
    bitwise ``clean``'s end."""
    assert problem(saved) is None
    assert_same_checkpoint(saved, clean / "checkpoints" / f"step_{AT:09d}", world)
    code, out = job(run, world, "ranks", "b", *more)
    assert code == 0, out[-4000:]
    assert f"resumed from {saved} (step {AT}," in out
    assert_same_end(run, clean, world, since=AT)


def published(out: Path) -> list[Path]:
    """The copies a job's ranks published (each rank prints its path at start)."""
    text = "".join(f.read_text() for f in out.glob("*.out"))
    return [Path(p) for p in re.findall(r"published part at (\S+)", text)]


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict[int, Path]:
    """The uninterrupted runs, 2 and 4 ranks, with a periodic save at step 67."""
    runs = {}
    for world in (2, 4):
        run_dir = tmp_path_factory.mktemp(f"clean{world}")
        argv = [sys.executable, *args(run_dir, "--every", AT)]
        ranks = run_ranks(argv, world, out=run_dir / "out", timeout_s=120)
        assert all(r.code == 0 for r in ranks), [r.out[-2000:] for r in ranks]
        # A run that ends leaves no copy behind.
        assert len(published(run_dir / "out")) == world
        assert not any(p.exists() for p in published(run_dir / "out"))
        runs[world] = run_dir
    return runs


@pytest.fixture(scope="module")
def clean6(tmp_path_factory) -> dict[int, Path]:
    """The uninterrupted run at 6 ranks (three simulated nodes' worth)."""
    run_dir = tmp_path_factory.mktemp("clean6")
    argv = [sys.executable, *args(run_dir, "--every", AT)]
    ranks = run_ranks(argv, 6, out=run_dir / "out", timeout_s=120)
    assert all(r.code == 0 for r in ranks), [r.out[-2000:] for r in ranks]
    return {6: run_dir}


def job(run_dir: Path, world: int, launcher: str, out: str, *more: object) -> tuple[int, str]:
    """The worker's ranks, by ``launcher``: each rank its own process with rank 0 hosting
    the store (``ranks``), or under torchrun, whose agent hosts it: the exit code
    (rank 0's, or torchrun's) and what they printed."""
    if launcher == "ranks":
        argv = [sys.executable, *args(run_dir, *more)]
        ranks = run_ranks(argv, world, out=run_dir / out, timeout_s=120)
        return ranks[0].code or max(abs(r.code) for r in ranks), ranks[0].out
    done = torchrun(args(run_dir, *more), world, out=run_dir / out)
    return done.code, done.out + (run_dir / out / "rank0.err").read_text()


TORCHRUN = pytest.mark.slow(reason="a real torchrun job, twice")
THREE_NODES = pytest.mark.slow(reason="6 ranks twice")
STORE_LOST = pytest.mark.slow(reason="4 ranks twice, rank 0 and its store SIGKILLed")
TERM_FIRST = pytest.mark.slow(reason="two 2-rank jobs, one waiting out a signal's teardown")


@pytest.mark.parametrize(
    ("launcher", "world", "killed", "kill"),
    [
        ("ranks", 4, 2, "kill"),
        # Rank 0 hosts the store here: the survivors meet in files (board.py).
        pytest.param("ranks", 4, 0, "kill", marks=STORE_LOST),
        # The launcher's SIGTERM reaches the survivors before their all-reduce fails
        # (torchrun's teardown on a loaded machine): no stop was agreed, and nothing was
        # saved; the failure save runs all the same, and the exit stays the signal's.
        pytest.param("ranks", 2, 1, "term_then_kill", marks=TERM_FIRST),
        # Under torchrun (its agent hosts the store) with rank 0 the dead one: the hardest
        # case of the launcher's (a 2-rank torchrun job with rank 1 killed added nothing
        # that this and ranks-4-2 do not check, for 44 s of CI's 14 minutes).
        pytest.param("torchrun", 4, 0, "kill", marks=TORCHRUN),
    ],
)
def test_a_killed_rank_costs_no_step(tmp_path, clean, launcher, world, killed, kill):
    """Rank ``killed`` SIGKILLed in the step after step 67 (the last periodic save: step
    50): a live rank writes its part from its published copy, and the failure save of
    step 67 is whole, bitwise the uninterrupted run's save of step 67; the same command
    again resumes it and redoes no step. Rank 0 killed: torchrun's agent hosts the
    store, so rank 1, the lowest live rank, commits (with the replicated state, its own
    copy, and rank 0's part from its published copy); without torchrun the store died
    with rank 0, and the survivors meet in files, the first done committing. No copy is
    left behind."""
    more = ("--fault", kill, "--at", AT, "--rank", killed, "--every", EVERY)
    code, out = job(tmp_path, world, launcher, "a", *more, "--hang-timeout-s", 3)
    assert code != 0
    if kill == "term_then_kill":
        assert code == 128 + 15, out[-4000:]
        assert f"the state of step {AT}, the last finished step, was saved" in out, out[-4000:]
    found = dict(list_checkpoints(tmp_path / "checkpoints"))
    assert sorted(found) == [EVERY, AT], out[-4000:]
    m = json.loads((found[AT] / "manifest.json").read_text())
    assert m["failure"]["missing"] == [] and m["ranks"] == list(range(world)), m["failure"]
    # (A survivor whose verdict came after the committer's wait, on a loaded machine, is
    # written from its copy too.)
    assert killed in m["failure"]["from_peers"]
    if killed == 0 and launcher == "ranks":  # the store died with rank 0: the first done commits
        assert m["failure"]["store"] == "lost" and m["failure"]["committed_by"] in (1, 2, 3)
    else:
        assert "store" not in m["failure"]
        assert m["failure"].get("committed_by", 0) == (1 if killed == 0 else 0)
    assert problem(found[AT]) is None
    assert_same_checkpoint(found[AT], clean[world] / "checkpoints" / f"step_{AT:09d}", world)
    assert not any(p.exists() for p in published(tmp_path / "a"))
    code, out = job(tmp_path, world, launcher, "b")
    assert code == 0, out[-4000:]
    assert f"resumed from {found[AT]} (step {AT}," in out  # no step redone
    assert_same_end(tmp_path, clean[world], world, since=AT)


@pytest.mark.parametrize(
    ("nodes", "lost"),
    [
        (2, [2, 3]),
        # Three nodes, the middle one lost: its ranks' mirrors are on the third node, not
        # on the committer's (rank 0); ranks 4 and 5 write ranks 2 and 3's parts.
        pytest.param(3, [2, 3], marks=THREE_NODES),
        # The first node: rank 0 hosts the store (no torchrun), gone with it; the
        # survivors meet in files (board.py), the first done commits.
        pytest.param(2, [0, 1], marks=STORE_LOST),
        (1, [2, 3]),
    ],
)
def test_a_node_lost_whole_costs_no_step(request, tmp_path, nodes, lost):
    """Four ranks on two simulated nodes (``LOCAL_WORLD_SIZE=2``: ranks 0-1 and 2-3), one
    lost whole 0.3 s into the step after step 67: its ranks SIGKILLed, their own copies
    and the copies they kept of the other node's ranks gone with the node's memory. Each
    rank's copy went to a rank on the next node at every boundary (``partner.py``): the
    failure save of step 67 is whole, bitwise the uninterrupted run's save, and the same
    command resumes it, redoes no step and ends bitwise. Six ranks on three nodes, the
    middle one lost: the partners on the third node write the lost ranks' parts. The
    control, ``nodes=1`` (``LOCAL_WORLD_SIZE=4``: one node as far as guardrails knows, so
    no copy leaves it): the same loss leaves the save incomplete, without ranks 2 and 3."""
    world = 6 if nodes == 3 else 4
    clean = request.getfixturevalue("clean6" if world == 6 else "clean")
    more = ("--fault", "node_lost", "--at", AT, "--rank", ",".join(map(str, lost)))
    env = {"LOCAL_WORLD_SIZE": str(4 if nodes == 1 else 2)}
    argv = [sys.executable, *args(tmp_path, *more, "--every", EVERY, "--hang-timeout-s", 3)]
    ranks = run_ranks(argv, world, out=tmp_path / "a", env=env, timeout_s=120)
    assert [ranks[r].code for r in lost] == [-9, -9]
    found = dict(list_checkpoints(tmp_path / "checkpoints"))
    assert sorted(found) == [EVERY, AT], [r.out[-3000:] for r in ranks]
    failure = json.loads((found[AT] / "manifest.json").read_text())["failure"]
    if nodes == 1:
        assert failure["missing"] == [2, 3] and "from_peers" not in failure, failure
        assert "incomplete failure save" in problem(found[AT])[1]
        return
    assert failure["missing"] == [] and failure["from_peers"] == lost, failure
    assert failure.get("by_partner", []) == (lost if nodes == 3 else failure.get("by_partner", []))
    assert problem(found[AT]) is None
    # Their partners saw their connections end without a goodbye: not waited for (the
    # wait for a rank that never begins its part is 10 s).
    committer = failure.get("committed_by", 0)
    [said] = [
        e for e in read_events(tmp_path) if e["kind"] == "failure_saved" and e["rank"] == committer
    ]
    assert said["seconds"] < 10, said
    assert all("copies sent to rank" in ranks[r].out for r in lost)
    assert_same_checkpoint(found[AT], clean[world] / "checkpoints" / f"step_{AT:09d}", world)
    # Nothing left in /dev/shm: no copy, no partner's copy.
    assert not any(p.exists() for p in published(tmp_path / "a"))
    copy = published(tmp_path / "a")[0]
    token = copy.name.rpartition("-rank")[0]
    assert not list(copy.parent.glob(f"{token}-rank*-mirror"))
    ranks = run_ranks([sys.executable, *args(tmp_path)], world, out=tmp_path / "b", env=env)
    assert all(r.code == 0 for r in ranks), [r.out[-3000:] for r in ranks]
    assert f"resumed from {found[AT]} (step {AT}," in ranks[0].out  # no step redone
    assert_same_end(tmp_path, clean[world], world, since=AT)


def test_a_rank_a_step_ahead_of_the_committer_is_saved_from_its_boundary_before(tmp_path, clean):
    """Rank 0 raises after step 68's backward (DDP's all-reduce done): its last finished
    step is 67, while rank 1 finishes step 68 and publishes its boundary before it waits
    in step 69's all-reduce. Rank 0 saves step 67 and rank 1 never writes its part of it
    (it saves step 68, whose committer never comes): rank 0 writes rank 1's part from
    rank 1's copy, which keeps its last two boundaries, 68 and 67. Step 67 is whole,
    bitwise the uninterrupted run's, and the resume redoes one step, not 17 (back to
    the periodic save of step 50, as with a copy of the last boundary only)."""
    more = ("--fault", "forward", "--at", AT, "--rank", 0, "--every", EVERY)
    code, out = job(tmp_path, 2, "ranks", "a", *more, "--hang-timeout-s", 3, "--save-timeout-s", 15)
    assert code != 0
    found = dict(list_checkpoints(tmp_path / "checkpoints"))
    assert AT in found, out[-4000:]
    failure = json.loads((found[AT] / "manifest.json").read_text())["failure"]
    assert failure["missing"] == [] and failure["from_peers"] == [1], failure
    assert_resumed_whole(tmp_path, clean[2], 2, found[AT])


@pytest.mark.parametrize("draws", ["torch", "torch_after"])
def test_a_rank_killed_after_its_update_leaves_its_part_of_that_step(tmp_path, draws):
    """Rank 1 SIGKILLed right after the update that finished step 67, before its step
    boundary (where a loop logs, calls ``loss.item()``, evaluates): rank 0 finishes step
    67 too and saves it. Rank 1's copy was published after its update as well, and its
    boundaries found that copy equal to the boundary's every time (the loop draws from
    torch's RNG only before its forward): step 67 is whole, bitwise the uninterrupted
    run's save, and the resume redoes no step. ``torch_after``: the loop draws after the
    update, the boundaries saw it, and the copy after the update is refused, saying why
    (the save is incomplete, never silently another state)."""
    more = ("--fault", "kill_after", "--at", AT, "--rank", 1, "--every", EVERY)
    code, out = job(tmp_path, 2, "ranks", "a", *more, "--draws", draws, "--hang-timeout-s", 3)
    assert code != 0
    found = dict(list_checkpoints(tmp_path / "checkpoints"))
    assert sorted(found) == [EVERY, AT], out[-4000:]
    failure = json.loads((found[AT] / "manifest.json").read_text())["failure"]
    if draws == "torch_after":
        assert failure["missing"] == [1] and "from_peers" not in failure, failure
        [said] = [e for e in read_events(tmp_path) if e["kind"] == "failure_saved"]
        assert "of step 66, not 67 (its loop draws from the RNG" in said["message"], said
        return
    assert failure["missing"] == [] and failure["from_peers"] == [1], failure
    clean = tmp_path / "clean"
    argv = [sys.executable, *args(clean, "--every", AT, "--draws", draws)]
    ranks = run_ranks(argv, 2, out=clean / "out", timeout_s=120)
    assert all(r.code == 0 for r in ranks), [r.out[-2000:] for r in ranks]
    assert_resumed_whole(tmp_path, clean, 2, found[AT], "--draws", draws)


def test_a_killed_rank_that_prefetched_is_saved_to_fetch_its_batch_again(tmp_path):
    """nanoGPT's loop (the next batch fetched after the forward, its rows drawn from
    torch's RNG by a fast-forwarded loader): rank 1 SIGKILLed at the top of the step
    after step 67, holding the batch it fetched in step 67. Its copy holds torch's
    state from before that fetch, so its part is written with the batch not yet
    fetched (rank 0's holds its own batches' bytes): step 67 is whole, and the same
    command again redoes no step, fetches the same batches and ends bitwise the
    uninterrupted run's end."""
    more = ("--prefetch", "--fault", "kill", "--at", AT, "--rank", 1, "--every", EVERY)
    code, out = job(tmp_path, 2, "ranks", "a", *more, "--hang-timeout-s", 3)
    assert code != 0
    found = dict(list_checkpoints(tmp_path / "checkpoints"))
    assert sorted(found) == [EVERY, AT], out[-4000:]
    failure = json.loads((found[AT] / "manifest.json").read_text())["failure"]
    assert failure["missing"] == [] and failure["from_peers"] == [1], failure
    data = {r: json.loads((found[AT] / f"rank{r:05d}.json").read_text())["data"] for r in (0, 1)}
    assert data[0]["kind"] == data[1]["kind"] == "fast_forward", data
    assert data[0]["held"] and "held" not in data[1], data  # rank 1 fetches its own again
    clean = tmp_path / "clean"
    argv = [sys.executable, *args(clean, "--prefetch", "--every", AT)]
    ranks = run_ranks(argv, 2, out=clean / "out", timeout_s=120)
    assert all(r.code == 0 for r in ranks), [r.out[-2000:] for r in ranks]
    code, out = job(tmp_path, 2, "ranks", "b", "--prefetch")
    assert code == 0, out[-4000:]
    assert f"resumed from {found[AT]} (step {AT}," in out  # no step redone
    assert_same_end(tmp_path, clean, 2, since=AT)


def test_a_rank_killed_while_its_periodic_save_is_written_costs_no_step(tmp_path, clean):
    """A periodic save of step 67 begun in the background, rank 1 SIGKILLed at the top of
    the next step, before its part of that save is written: the save can never commit,
    and the failure save of the same step must not count it as saved (it did: nothing
    was saved, and the run went back to its previous checkpoint). Step 67 is whole,
    bitwise the uninterrupted run's, and the same command resumes it. Rank 0 ends once
    its failure save is written: the periodic save it supersedes, waiting for rank 1's
    files, is abandoned (rank 0 waited for it until its close's bound, 35 s)."""
    more = ("--fault", "kill", "--at", AT, "--rank", 1, "--every", AT, "--background")
    code, out = job(tmp_path, 2, "ranks", "a", *more, "--hang-timeout-s", 3)
    assert code != 0
    found = dict(list_checkpoints(tmp_path / "checkpoints"))
    assert sorted(found) == [AT], out[-4000:]
    said = {e["kind"]: e for e in read_events(tmp_path) if e["rank"] == 0}
    assert said["end"]["time"] - said["failure_saved"]["time"] < 10, out[-4000:]
    assert_resumed_whole(tmp_path, clean[2], 2, found[AT])


def test_a_copy_is_read_only_whole_and_only_by_its_job(tmp_path):
    """A rank's published copy (one process here: a real guard's boundary) is read back
    as the part it published; never under another job's token (a stale file a dead
    earlier job left), never torn (its rank died in the middle of a write: the boundary
    counts framing it differ), and removed at close."""
    import guardrails
    from guardrails.guards.checkpointer import peer

    model = torch.nn.Sequential(torch.nn.Linear(8, 1), torch.nn.Dropout(0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.randn(32, 8), batch_size=4, shuffle=True)
    with guardrails.guard(model, opt, loader, run_dir=tmp_path / "run", progress=False) as g:
        slot = peer.PeerSlot(tmp_path, "job1", 3)
        for x in g:
            if g.step == 5:  # at the boundary of step 5 (the checkpointer's hook's place)
                slot.publish(g)
                break
            model(x * random.random()).sum().backward()  # python's stream drawn each step
            opt.step()
            opt.zero_grad()
        got, why = peer.read_peer(tmp_path, "job1", 3)
        assert got is not None, why
        assert (got.rank, got.step, got.position) == (3, 5, (0, 5)), got
        assert torch.equal(got.torch["torch.cpu"], g.boundary_capture.torch[0])
        assert got.python == g.boundary_capture.python and got.streams_fresh
        assert set(got.tensors) == {f"epoch_start.{k}" for k in g.data_position.epoch_start}
    assert peer.read_peer(tmp_path, "job2", 3) == (None, "its published copy is not on this host")
    stale = peer.slot_path(tmp_path, "job2", 3)
    stale.write_bytes(slot.path.read_bytes())  # job1's copy under job2's name
    assert peer.read_peer(tmp_path, "job2", 3)[1] == "its published copy belongs to another job"
    # Torn: the half the next boundary writes (the other half, by the count's parity)
    # has its start's count and not its end's. The half before it is still whole, and
    # read when asked for its step; the newest is not (it died writing it).
    torn = bytearray(slot.path.read_bytes())
    count = g.boundary_capture.count
    begin = ((count + 1) % 2) * peer.SLOT_BYTES + peer.INTS_AT + 8 * peer.BEGIN
    torn[begin : begin + 8] = (count + 1).to_bytes(8, "little")
    slot.path.write_bytes(bytes(torn))
    assert "being written when it died" in peer.read_peer(tmp_path, "job1", 3)[1]
    assert "being written when it died" in peer.read_peer(tmp_path, "job1", 3, step=6)[1]
    assert peer.read_peer(tmp_path, "job1", 3, step=5)[0].step == 5
    slot.close()
    assert not slot.path.exists()


def test_a_partner_keeps_the_copy_of_the_rank_on_the_node_before(tmp_path):
    """The link between two ranks on different nodes (two in one process here, real
    sockets through a real TCPStore): a stranger that connects first with another job's
    token is turned away; the partner's mirror is then read back (``read_peer``, its own
    copy gone: another host's) as the part the rank published, at the boundary of step
    5, and is removed at close, the link's threads ended."""
    import socket

    import guardrails
    from guardrails.guards.checkpointer import partner, peer

    assert partner.partner_ranks(5, 8, 4) == (1, 1)
    assert partner.partner_ranks(1, 12, 4) == (5, 9)
    assert partner.partner_ranks(0, 4, 4) is None  # one node: nothing to send
    assert partner.partner_ranks(0, 6, 4) is None  # unequal nodes: no layout to trust
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mine, theirs = tmp_path / "node0", tmp_path / "node1"
    mine.mkdir(), theirs.mkdir()
    model = torch.nn.Sequential(torch.nn.Linear(8, 1), torch.nn.Dropout(0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.randn(32, 8), batch_size=4, shuffle=True)
    with guardrails.guard(model, opt, loader, run_dir=tmp_path / "run", progress=False) as g:
        slot, other = peer.PeerSlot(mine, "job1", 2), peer.PeerSlot(theirs, "job1", 0)
        keeper = partner.PartnerLink(store, other, theirs, "job1", 0, (2, 2))
        host, _, port = store.get("job1/partner/0").decode().rpartition(":")
        with socket.create_connection((host, int(port))) as stranger:
            stranger.sendall(partner._HELLO.pack(b"job9", 2))
            assert stranger.recv(1) == b""  # closed on it
        sender = partner.PartnerLink(store, slot, mine, "job1", 2, (0, 0))
        states = {}  # torch's generator at each boundary, as the copy must hold it
        for x in g:
            if g.step:  # the checkpointer's boundary, then the link's
                slot.publish(g)
                sender.sent()
                states[g.step] = g.boundary_capture.torch[0].clone()
            if g.step == 5:
                break
            model(x * random.random()).sum().backward()
            opt.step()
            opt.zero_grad()
        slot.path.unlink()  # rank 2's host is gone with its copy
        deadline = time.monotonic() + 30  # the last boundary's copy on its way
        while time.monotonic() < deadline:
            got, why = peer.read_peer(theirs, "job1", 2)
            if got is not None and got.step == 5:
                break
            time.sleep(0.01)
        assert got is not None, why
        assert (got.rank, got.step, got.position, got.source) == (
            2, 5, (0, 5), "its partner's copy"
        ), got  # fmt: skip
        assert torch.equal(got.torch["torch.cpu"], g.boundary_capture.torch[0])
        assert got.python == g.boundary_capture.python and got.streams_fresh
        # The boundary before is kept too (a rank a step ahead of the committer's save).
        before, why = peer.read_peer(theirs, "job1", 2, step=4)
        assert before is not None and (before.step, before.position) == (4, (0, 4)), why
        assert torch.equal(before.torch["torch.cpu"], states[4])
        assert not torch.equal(states[4], states[5])  # dropout drew between them
    mirror = peer.mirror_path(theirs, "job1", 2)
    assert mirror.exists() and keeper.frames_kept >= 1
    sender.close()  # a goodbye: rank 2 is not dead
    keeper._threads[0].join(timeout=10)
    assert peer.gone_ranks(theirs, "job1") == set()
    keeper.close()
    other.close()
    assert not mirror.exists()
    assert not any(t.is_alive() for t in keeper._threads + sender._threads)


_WRITE_COPIES_AND_DIE = """
import os, signal, sys
sys.path.insert(0, {root!r})
from pathlib import Path
from guardrails.guards.checkpointer import peer
for token, rank in {copies!r}:
    peer.PeerSlot(Path({directory!r}), token, rank)._open()
if {die!r}:
    os.kill(os.getpid(), signal.SIGKILL)
print("written", flush=True)
sys.stdin.read()  # alive until the test closes our stdin
"""


def _copies(directory: Path, copies: list[tuple[str, int]], *, die: bool):
    import subprocess

    root = str(Path(__file__).resolve().parents[2])
    script = _WRITE_COPIES_AND_DIE.format(
        root=root, copies=copies, directory=str(directory), die=die
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    if die:
        assert proc.wait(timeout=60) == -9
    else:
        assert proc.stdout.readline() == "written\n"
    return proc


def test_copies_a_killed_job_left_are_swept_at_the_next_jobs_start(tmp_path):
    """A job SIGKILLed whole leaves its ranks' copies in /dev/shm (memory). The next job's
    first boundary removes them; it keeps every copy of a job one of whose writers is
    alive (a rank of it may be writing a failure save from them), a copy whose pid now
    names another process (a reused pid: not its writer), and files it cannot judge."""
    import guardrails
    from guardrails.guards.checkpointer import peer

    _copies(tmp_path, [("dead", 0), ("dead", 1)], die=True)
    _copies(tmp_path, [("half", 1)], die=True)
    live = _copies(tmp_path, [("half", 0), ("live", 0)], die=False)
    try:
        # Written by this process, but its start time is not ours: the pid was reused.
        _copies(tmp_path, [("reused", 0)], die=True)
        reused = peer.slot_path(tmp_path, "reused", 0)
        head = bytearray(reused.read_bytes())
        peer._WRITER.pack_into(head, peer._WRITER_AT, os.getpid(), 1, peer._writer_id()[2])
        reused.write_bytes(bytes(head))
        # Another host's (a node-local directory someone shares): not ours to judge.
        _copies(tmp_path, [("remote", 0)], die=True)
        remote = peer.slot_path(tmp_path, "remote", 0)
        head = bytearray(remote.read_bytes())
        head[peer.INTS_AT + 8 * peer.HOST : peer.INTS_AT + 8 * peer.HOST + 8] = b"\1" * 8
        remote.write_bytes(bytes(head))
        junk = tmp_path / "guardrails-peer-junk-rank0"
        junk.write_bytes(b"not a copy")
        # What a committer reads not to wait for a rank of its host that is gone: the
        # dead writer (and the reused pid's), never a live one or another host's.
        assert peer.gone_ranks(tmp_path, "half") == {1}
        assert peer.gone_ranks(tmp_path, "dead") == {0, 1}
        assert peer.gone_ranks(tmp_path, "reused") == {0}
        assert peer.gone_ranks(tmp_path, "remote") == set() == peer.gone_ranks(tmp_path, "live")

        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with guardrails.guard(model, opt, torch.randn(4, 8), run_dir=tmp_path / "run") as g:
            slot = peer.PeerSlot(tmp_path, "mine", 0)
            for x in g:
                if g.step == 1:  # the first boundary: the copy is made, the dead swept
                    slot.publish(g)
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
            left = sorted(
                p.name.removeprefix("guardrails-peer-") for p in tmp_path.glob("guardrails-peer-*")
            )
            slot.close()
        assert left == [
            "half-rank0",
            "half-rank1",
            "junk-rank0",
            "live-rank0",
            "mine-rank0",
            "remote-rank0",
        ]
    finally:
        live.stdin.close()
        live.wait(timeout=60)
    # Once the last writer of "half" and "live" is gone, the next start sweeps them too.
    assert sorted(p.name for p in peer.sweep(tmp_path, "next")) == [
        "guardrails-peer-half-rank0",
        "guardrails-peer-half-rank1",
        "guardrails-peer-live-rank0",
    ]


def test_a_rank_that_finds_the_store_gone_keeps_a_step_committed_whole(tmp_path):
    """Outside torchrun rank 0 hosts the store: once it committed a failure save whole it
    exits, and a rank whose own save came later finds the store gone and meets on the
    board. It must take the committed step, not commit over it with the others missing
    (4 ranks, rank 2 killed: rank 3 committed with ranks 0-2 missing, seen in CI)."""
    from guardrails.guards.checkpointer.board import FileBoard

    board = FileBoard(tmp_path, "job", 7, 4)
    assert board.committed_whole() is None  # nothing committed: the board's own save
    final = tmp_path / "step_000000007"
    final.mkdir()
    (final / "manifest.json").write_text(json.dumps({"failure": {"missing": [2]}}))
    assert board.committed_whole() is None  # an incomplete one: this rank may complete it
    (final / "manifest.json").write_text(json.dumps({"failure": {"missing": []}}))
    assert board.committed_whole() == final
