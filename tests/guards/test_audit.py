"""CollectiveAuditor: real processes, real gloo, real desyncs.

Each multi-rank test launches this file as a script, one process per rank (or through
``torch.distributed.run``), with a planted desync; every process must end within
``patience(BOUND_S)`` and report a CollectiveMismatchError naming each rank's op and the test's
own line. Where gloo itself kills a rank first (a size mismatch aborts the receiving
process within milliseconds), the surviving rank reports the mismatch instead of gloo's
"Connection reset by peer".
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _ranks import launch, torchrun
from conftest import Regressor, batches, free_port, read_events, spawn
from torch.nn.parallel import DistributedDataParallel as DDP

import guardrails
from guardrails import CollectiveAuditor, CollectiveMismatchError, Guard, NanGuard
from guardrails.guards.audit.calls import OPS
from guardrails.guards.audit.flight import _HEADER, _ring_dir, _sweep_stale_rings
from guardrails.guards.audit.seq import _History

HERE = Path(__file__).resolve()
BOUND_S = 90.0  # generous (typical is ~10 s); _ranks stretches it by patience() when busy
STEPS = 40


def _line(marker: str) -> int:
    """The line of this file that holds ``marker`` (the call site a report must name)."""
    for i, text in enumerate(HERE.read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# <{marker}>"):
            return i
    raise AssertionError(marker)


# ---------------------------------------------------------------------- the worker


def _scenario_step(scenario: str, rank: int, step: int, model: torch.nn.Module) -> None:
    """One step's collectives after backward: the planted fault, then the gradients'
    all-reduce (DDP does its own, inside backward)."""
    if step == 3:
        if scenario == "extra_diff" and rank == 0:
            dist.all_reduce(torch.ones(3))  # <extra_diff>
        if scenario.startswith("extra_same") and rank == 0:
            dist.all_reduce(torch.ones(49))  # <extra_same>
        if scenario == "rank0_branch" and rank == 0:
            save_on_rank0(model)
        if scenario == "swapped":
            a, b = torch.ones(5), torch.ones(7, dtype=torch.float64)
            if rank != 1:
                dist.all_reduce(a)  # <swapped_a>
                dist.all_reduce(b)
            else:
                dist.all_reduce(b)  # <swapped_b>
                dist.all_reduce(a)
    if not isinstance(model, DDP):
        for p in model.parameters():
            dist.all_reduce(p.grad)  # <grads>
    if step == 3 and scenario == "stray_flag" and rank == 0:
        # The size and place of a NaN flag agreement: before guardrails agreed on its
        # own group, this paired with it and rank 1 skipped a healthy step.
        dist.all_reduce(torch.ones(1))  # <stray_flag>


def save_on_rank0(model: torch.nn.Module) -> None:
    """The classic desync: "only rank 0 does something that includes a collective"."""
    dist.barrier()  # <rank0_branch>


def recording_hook(g: Guard) -> Callable:
    """A DDP comm hook as GuardedDDP's: report the bucket to the auditor, then all-reduce
    it through the process group (not the intercepted Python API, so it counts once)."""

    # No annotations: DDP checks them, and `from __future__ import annotations` makes
    # them strings.
    def hook(state, bucket):
        buffer = bucket.buffer()
        if g.auditor is not None:
            site = f"DDP gradient all-reduce (bucket {bucket.index()})"
            g.auditor.record("all_reduce", [buffer], reduce_op=dist.ReduceOp.SUM, site=site)
        buffer.div_(dist.get_world_size())
        fut = dist.distributed_c10d._get_default_group().allreduce([buffer]).get_future()
        return fut.then(lambda f: f.value()[0])

    return hook


def _clean_extras(g: Guard, rank: int, result: dict) -> None:
    """Inside a clean run: async and point-to-point calls, a record() from another
    thread, our side group, and the per-call work on the main thread, counted."""
    # Objects of rank-dependent sizes (torch pads them to one size): no mismatch, and
    # torch's helpers calling intercepted functions are recorded at this line, once.
    dist.broadcast_object_list([list(range(50)) if rank == 0 else None], src=0)  # <objects>
    dist.all_gather_object([None, None], "x" * (10 + 500 * rank))
    dist.gather_object("y" * (5 + 50 * rank), [None, None] if rank == 0 else None, dst=0)
    with warnings.catch_warnings():  # deprecated in torch 2.13: calls all_gather_single
        warnings.simplefilter("ignore")
        dist.all_gather_into_tensor(torch.zeros(4), torch.ones(2))
    result["objects"] = [(e[2], f"{e[8]}:{e[9]}") for e in list(g.auditor.recent)[-7:]]
    work = dist.all_reduce(torch.ones(3), async_op=True)  # <async>
    result["collective_after_async"] = g.collective
    work.wait()
    t = torch.zeros(2)
    (dist.isend(t, 1) if rank == 0 else dist.irecv(t, 0)).wait()
    (dist.send if rank == 0 else dist.recv)(t, 1 - rank)
    th = threading.Thread(target=g.auditor.record, args=("all_reduce", [torch.ones(4)]))
    th.start()
    th.join()
    dist.all_reduce(torch.ones(2), group=g.side_group)
    result["recent"] = [(e[2], e[3], f"{e[8]}:{e[9]}") for e in g.auditor.recent]
    result["calls"] = {n: _calls_per_collective(n) for n in (10, 40)}


def _calls_per_collective(n: int) -> dict:
    """Python calls into guardrails and store calls made on the main thread during
    ``n`` all-reduces (sys.setprofile sees this thread only)."""
    counts: dict[str, int] = {}
    pkg = str(Path(guardrails.__file__).parent)

    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(pkg):
            counts[frame.f_code.co_name] = counts.get(frame.f_code.co_name, 0) + 1
        elif event == "c_call" and isinstance(getattr(arg, "__self__", None), dist.Store):
            counts["store." + arg.__name__] = counts.get("store." + arg.__name__, 0) + 1

    t = torch.ones(4)
    try:
        for i in range(n + 1):
            if i == 1:  # after the first call: a site's record is formatted once, cached
                sys.setprofile(prof)
            dist.all_reduce(t)
    finally:
        sys.setprofile(None)
    return counts


def worker(scenario: str, out: str) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model: torch.nn.Module = Regressor(depth=1)
    if scenario == "extra_same":
        # DDP: one bucket, so every gradient all-reduce has the same shape and rank 0's
        # extra call pairs with rank 1's next bucket without any backend error.
        model = DDP(model)
    elif scenario == "extra_same_gddp":  # GuardedDDP, with its own audited hook
        model = guardrails.GuardedDDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    result: dict = {"rank": rank, "type": None}
    modules = (dist, dist.distributed_c10d)
    before = {(m.__name__, op): getattr(m, op, None) for m in modules for op in OPS}
    try:
        if scenario.startswith("torchrun"):
            scenario = scenario.partition(":")[2] or "rank0_branch"
            g = guardrails.guard(
                model, opt, batches(STEPS, seed=rank), run_dir=f"{out}/run", progress=False
            )
        else:
            # No DDP: the ranks' gradients differ at step() (the loop all-reduces them
            # itself), so NanGuard agrees on its flag every step.
            nan = [NanGuard()] if scenario == "stray_flag" else []
            g = Guard(
                model,
                opt,
                batches(STEPS, seed=rank),
                run_dir=f"{out}/run",
                components=[*nan, CollectiveAuditor(abort_after_s=2.0)],
            )
        if type(model) is DDP:
            model.register_comm_hook(None, recording_hook(g))
        with g:
            for x, y in g:
                model(x, y).backward()
                _scenario_step(scenario, rank, g.step, model)
                opt.step()  # <step>
                opt.zero_grad()
                time.sleep(0.02)  # a step of 20 ms: the run outlives a few audit intervals
            result["collective_after"] = g.collective
            if scenario == "clean":
                _clean_extras(g, rank, result)
    except Exception as exc:
        result.update(type=type(exc).__name__, message=str(exc))
        if isinstance(exc, CollectiveMismatchError):
            result.update(per_rank=exc.per_rank, seq=exc.seq, group=exc.group, err_rank=exc.rank)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result, default=str))
        sys.exit(1)
    after = {(m.__name__, op): getattr(m, op, None) for m in modules for op in OPS}
    result["restored"] = all(after[k] is v for k, v in before.items())
    Path(out, f"rank{rank}.json").write_text(json.dumps(result, default=str))
    dist.destroy_process_group()


# ---------------------------------------------------------------------- launching


def run_ranks(tmp_path: Path, scenario: str, world: int = 2) -> list[dict]:
    """Run ``world`` ranks of ``scenario``; return per rank: exit code, stderr, result."""
    job = launch([sys.executable, HERE, scenario, tmp_path], world, out=tmp_path, merge=False)
    try:
        ranks = job.wait(BOUND_S)
    finally:
        job.kill()
        _remove_rings({p.pid for p in job.procs})
    return [{"code": r.code, "stderr": r.err, "result": r.json("rank{rank}.json")} for r in ranks]


def _remove_rings(pids: set[int]) -> None:
    """Remove the flight recorders our ranks could not: one aborted by gloo keeps its
    file (it is what the survivor read)."""
    for path in Path(_ring_dir()).glob("guardrails-audit-*"):
        with contextlib.suppress(OSError, struct.error):
            if _HEADER.unpack(path.read_bytes()[: _HEADER.size])[2] in pids:
                path.unlink()


def _report(run: dict) -> str | None:
    """The CollectiveMismatchError text a rank showed: raised in the loop (result
    file) or printed by the process ending itself while stuck in a collective."""
    res = run["result"]
    if res is not None and res["type"] == "CollectiveMismatchError":
        return res["message"]
    if "CollectiveMismatchError" in run["stderr"]:
        return run["stderr"]
    return None


# What gloo prints when it aborts a rank that received more bytes than it expected:
# torch 2.13's gloo names the cause; 2.8's (read in its wheel) only its failed check.
GLOO_ABORTS = ("Is there a distributed collective mismatch", "op.preamble.length <= op.nbytes")


def assert_mismatch(
    runs: list[dict], *, sites: list[str], ops: list[str], all_ranks: bool = False
) -> list[str]:
    """Every rank gloo did not abort (or, with ``all_ranks``, every rank) reports the
    mismatch, naming every rank, the ops and the call sites; every rank exits non-zero."""
    reports = []
    for rank, run in enumerate(runs):
        report = _report(run)
        aborted = any(text in run["stderr"] for text in GLOO_ABORTS)
        assert report is not None or (aborted and not all_ranks), (
            rank,
            run["code"],
            run["stderr"][-3000:],
        )
        assert run["code"] != 0, rank
        if report is not None:
            reports.append(report)
    assert reports, [r["stderr"][-2000:] for r in runs]
    for text in reports:
        assert "collective mismatch on the default group" in text
        for rank in range(len(runs)):
            assert f"rank {rank}:" in text, text
        for site in sites:
            assert f"test_audit.py:{_line(site)}" in text, (site, text)
        for op in ops:
            assert op in text, (op, text)
        assert "fix:" in text
    return reports


# ---------------------------------------------------------------------- desyncs


@pytest.mark.slow(reason="2 ranks (gloo)")
def test_extra_collective_with_another_shape(tmp_path):
    # gloo aborts the rank that receives more bytes than it expects within milliseconds
    # ("Is there a distributed collective mismatch"); the other rank's "Connection reset
    # by peer" becomes the mismatch, read from the dead rank's flight recorder (the
    # store died with rank 0 here: it hosts it outside torchrun).
    runs = run_ranks(tmp_path, "extra_diff")
    reports = assert_mismatch(runs, sites=["extra_diff", "grads"], ops=["all_reduce(SUM)"])
    assert any("float32[3]" in text and "float32[8, 4]" in text for text in reports)


@pytest.mark.slow(reason="2 ranks (gloo), GuardedDDP")
def test_the_first_rank_names_the_mismatch_when_gloo_aborted_the_last(tmp_path):
    # The other way round: rank 1 issues the extra call (GuardedDDP: its buckets are in
    # the audited sequence) and gloo aborts rank 1. Rank 0, the group's first member,
    # has no member before it to compare with: at close it compares with the one after
    # it, from that rank's flight recorder.
    worker = HERE.parents[1] / "hang_worker.py"
    cmd = [sys.executable, worker, "extra", "--hang-timeout-s", 5, "--out", tmp_path]
    with launch(cmd, out=tmp_path, error_files=True) as job:
        first, last = job.wait(BOUND_S)
    assert last.code != 0 and first.code == 82, first.out[-3000:]
    extra = first.error["message"]["extraInfo"]
    assert extra["error_class"] == "CollectiveMismatchError", extra
    assert "collective mismatch on the default group" in extra["py_callstack"]


# DDP with the test's recording hook, and the real GuardedDDP (its own hook reports
# each bucket to the auditor).
@pytest.mark.parametrize("scenario", ["extra_same", "extra_same_gddp"])
@pytest.mark.slow(reason="2 ranks (gloo) per case")
def test_extra_same_shape_collective_pairing_with_ddp_does_not_pass_silently(tmp_path, scenario):
    # Plain PyTorch raises nothing: rank 0's extra all_reduce pairs with rank 1's next
    # DDP gradient bucket and training goes on with mixed-up gradients.
    runs = run_ranks(tmp_path, scenario)
    reports = assert_mismatch(runs, sites=["extra_same"], ops=["all_reduce(SUM)"], all_ranks=True)
    assert all("DDP gradient all-reduce (bucket 0)" in text for text in reports)
    for run in runs:
        r = run["result"]
        if r is None:  # ended itself while stuck in a collective: the report is on stderr
            continue
        per_rank = {int(k): v for k, v in r["per_rank"].items()}
        assert per_rank[0]["site"].endswith(f"test_audit.py:{_line('extra_same')}")
        assert per_rank[1]["site"] == "DDP gradient all-reduce (bucket 0)"
        assert per_rank[0]["shape"] == per_rank[1]["shape"] == "[49]"
        assert (per_rank[0]["step"], per_rank[1]["step"]) == (3, 4)
        assert r["group"] == "default" and r["seq"] == per_rank[0]["seq"]
        assert r["err_rank"] == r["rank"]


@pytest.mark.slow(reason="2 ranks (gloo)")
def test_a_stray_flag_sized_all_reduce_is_a_mismatch_not_a_false_skip(tmp_path):
    # guardrails' own agreements (NanGuard's flag here) run on its gloo side group, so
    # a user's stray 1-float all_reduce on rank 0 cannot pair with one of them; the
    # agreement is in the auditor's sequence, so the stray call is named against it
    # (rather than rank 0 waiting on the training's group and rank 1 on guardrails').
    runs = run_ranks(tmp_path, "stray_flag")
    reports = assert_mismatch(
        runs, sites=["stray_flag", "step"], ops=["all_reduce(SUM)"], all_ranks=True
    )
    assert all("guardrails NaN-flag agreement" in text for text in reports)
    events = read_events(tmp_path / "run")
    assert [e for e in events if e["kind"].startswith("nonfinite")] == []


@pytest.mark.slow(reason="3 ranks (gloo)")
def test_swapped_collectives_on_three_ranks(tmp_path):
    runs = run_ranks(tmp_path, "swapped", world=3)
    reports = assert_mismatch(runs, sites=["swapped_a", "swapped_b"], ops=["all_reduce"])
    assert any("float32[5]" in t and "float64[7]" in t for t in reports)


@pytest.mark.slow(reason="2 ranks (gloo)")
def test_collective_in_a_rank0_only_branch(tmp_path):
    # gloo would wait 30 minutes here (rank 0 in a barrier, rank 1 in an all_reduce).
    runs = run_ranks(tmp_path, "rank0_branch")
    assert_mismatch(
        runs, sites=["rank0_branch", "grads"], ops=["barrier", "all_reduce"], all_ranks=True
    )


def _torchrun(tmp_path: Path, scenario: str) -> tuple[int, str]:
    proc = torchrun([HERE, scenario, tmp_path], out=tmp_path / "torchrun", timeout_s=BOUND_S)
    return proc.code, proc.err


@pytest.mark.slow(reason="torchrun and its 2 ranks")
def test_torchrun_and_guard_defaults(tmp_path):
    # The whole stack as a user runs it: torchrun, guardrails.guard() defaults.
    code, err = _torchrun(tmp_path, "torchrun")
    assert code != 0
    # torchrun's summary names our error as the root cause (the rank that ended itself
    # while stuck in the collective wrote it to torchrun's error file) ...
    root_cause = err[err.index("Root Cause") :]
    assert "CollectiveMismatchError" in root_cause, err[-3000:]
    # ... and each rank either raised it in its loop or printed it when it ended itself.
    for rank in range(2):
        f = tmp_path / f"rank{rank}.json"
        if f.exists():
            text = json.loads(f.read_text())["message"]
        else:
            text = err[err.index(f"[rank {rank}, step") :]
        assert f"test_audit.py:{_line('rank0_branch')}" in text
        assert "barrier" in text and "all_reduce" in text


@pytest.mark.slow(reason="torchrun and its 2 ranks")
def test_gloo_abort_under_torchrun_is_explained_by_the_survivor(tmp_path):
    """gloo aborts rank 0 (it receives 32 bytes where it expects 4) and torchrun at once
    sends SIGTERM to rank 1, which is then explaining the mismatch from rank 0's flight
    recorder: the explanation is finished and reported (the guard holds SIGTERM while it
    closes with an error); before, rank 1 died of the SIGTERM (-15) with nothing said."""
    code, err = _torchrun(tmp_path, "torchrun:extra_diff")
    assert code != 0
    survivor = json.loads((tmp_path / "rank1.json").read_text())
    assert survivor["type"] == "CollectiveMismatchError", survivor
    text = survivor["message"]
    assert "rank 0:" in text and "rank 1:" in text
    assert "float32[3]" in text and "float32[8, 4]" in text
    assert f"test_audit.py:{_line('extra_diff')}" in text
    assert f"test_audit.py:{_line('grads')}" in text
    assert "(SIGTERM)" not in err, err[-3000:]


# ---------------------------------------------------------------------- clean runs


@pytest.mark.slow(reason="2 ranks (gloo)")
def test_clean_run_raises_nothing_and_records_o1_per_call(tmp_path):
    runs = run_ranks(tmp_path, "clean")
    for run in runs:
        res = run["result"]
        assert run["code"] == 0 and res is not None and res["type"] is None, run["stderr"][-3000:]
        recent = res["recent"]
        ops = [op for op, _, _ in recent]
        # async and point-to-point calls are seen; the side group's all_reduce is not.
        assert ops[-4:] == [
            "all_reduce",
            "isend" if res["rank"] == 0 else "irecv",
            "send" if res["rank"] == 0 else "recv",  # once: torch's send calls isend
            "all_reduce",
        ]
        assert recent[-1][2] == "DDP gradient all-reduce:0"  # record() from a thread
        assert recent[-4][2].endswith("test_audit.py:" + str(_line("async")))
        assert [kind for _, kind, _ in recent[-4:]] == ["coll", "p2p", "p2p", "coll"]
        objects = res["objects"]
        assert [op for op, _ in objects] == [
            *("broadcast", "broadcast"),  # broadcast_object_list: sizes, then the bytes
            *("all_gather", "all_gather"),  # all_gather_object
            *("all_gather", "gather"),  # gather_object
            "all_gather_into_tensor",  # not also all_gather_single, which it calls
        ]
        assert objects[0][1] == objects[1][1] == f"{HERE}:{_line('objects')}"
        assert res["collective_after"] is None  # cleared after each blocking call
        assert res["collective_after_async"] is None  # never set for an async one
        assert res["restored"]  # every patched attribute is the original object again
        # Per all_reduce on the main thread: a fixed number of Python calls into
        # guardrails (the wrapper and its bookkeeping) and no store call at all.
        few, many = res["calls"]["10"], res["calls"]["40"]
        assert not any(k.startswith("store.") for k in many), many
        assert {k: 4 * v for k, v in few.items()} == many, (few, many)
        assert sum(few.values()) <= 6 * 10, few  # wrapper, bookkeeping, ring, dict


# ---------------------------------------------------------------------- comparison


def _history(calls: list[tuple[str, int, int]]) -> _History:
    """A rank's record of ``(site, numel, step)`` all-reduces on the default group."""
    h = _History("default", [0, 1])
    for seq, (site, numel, step) in enumerate(calls, 1):
        h.add(
            (
                None,
                seq,
                "all_reduce",
                "coll",
                torch.Size([numel]),
                torch.float32,
                None,
                None,
                site,
                1,
                step,
                True,
            )
        )
    return h


def _steps(n: int, per_step: int = 3, start: int = 0) -> list[tuple[str, int, int]]:
    return [(f"train.py:{k}", 10 + k, s) for s in range(start, start + n) for k in range(per_step)]


def test_a_rank_ahead_is_compared_on_the_common_prefix_only():
    # Rank 0 is 300 calls ahead (far past the published window): no mismatch, because
    # the rolling-hash anchors cover the prefix both have issued.
    ahead, behind = _history(_steps(200)), _history(_steps(100))
    assert ahead.diverges_from(behind.published()) is None
    assert behind.diverges_from(ahead.published()) is None
    # Different lines issuing the same calls (a rank-dependent branch around a broadcast
    # on each side) are legitimate: not a mismatch.
    other_lines = _history([(f"other.py:{k}", n, st) for k, (_, n, st) in enumerate(_steps(100))])
    assert other_lines.diverges_from(behind.published()) is None


def test_divergence_is_found_inside_and_before_the_window():
    calls = _steps(100)
    changed = list(calls)
    changed[290] = ("train.py:99", 999, changed[290][2])
    a, b = _history(calls), _history(changed)
    assert a.diverges_from(b.published()) == (291, 291)
    # 200 calls later the difference is outside the published window; the anchors
    # still catch it (located at the first anchor after it).
    changed_early = list(calls)
    changed_early[10] = ("train.py:99", 999, 3)
    a, b = _history(calls + _steps(10, start=100)), _history(changed_early + _steps(10, start=100))
    first, _ = a.diverges_from(b.published())
    assert 11 <= first <= 64


def test_same_shape_extra_call_is_blamed_where_the_lines_first_differ():
    calls = _steps(10, per_step=1)
    extra = [*calls[:5], ("train.py:50", 10, 5), *calls[5:]]  # same op and shape, step 5
    a, b = _history(extra), _history(calls)
    assert a.diverges_from(b.published()) == (6, 7)  # #6: other line; #7: other step


def test_single_process_run_installs_nothing(tmp_path):
    original = dist.all_reduce
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = guardrails.guard(model, opt, batches(2), run_dir=tmp_path, progress=False)
    assert not any(isinstance(c, CollectiveAuditor) for c in g.components)
    aud = CollectiveAuditor()
    with Guard(model, opt, batches(2), run_dir=tmp_path, components=[aud]) as g2:
        # Not train_loop: each step first checks that all_reduce is still torch's own.
        for x, y in g2:
            assert dist.all_reduce is original
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    assert g2.auditor is None and aud._thread is None and dist.all_reduce is original
    assert aud.record("all_reduce", [torch.ones(2)]) == -1


def test_stale_flight_recorders_of_dead_processes_are_swept(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    paths = {}
    for who, pid in (("dead", int(dead.stdout)), ("alive", os.getpid())):
        path = Path(_ring_dir()) / f"guardrails-audit-test{os.getpid()}{who}-r0"
        path.write_bytes(_HEADER.pack(b"GRAUDIT1", 0, pid, 64))
        os.utime(path, (time.time() - 120, time.time() - 120))
        paths[who] = path
    try:
        _sweep_stale_rings()
        assert not paths["dead"].exists() and paths["alive"].exists()
    finally:
        for path in paths.values():
            path.unlink(missing_ok=True)


def test_knobs_are_checked():
    with pytest.raises(ValueError, match="interval_s"):
        CollectiveAuditor(interval_s=0)
    with pytest.raises(ValueError, match="close_wait_s"):
        CollectiveAuditor(close_wait_s=-1)
    with pytest.raises(TypeError, match="Did you mean `audit`"):
        guardrails.guard(Regressor(), torch.optim.SGD(Regressor().parameters()), audti=1)


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])


def _fsdp2_rank(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        mesh = init_device_mesh("cpu", (2,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = [torch.randn(4, 8) for _ in range(3)]
        with guardrails.guard(model, opt, data, run_dir=Path(out, "run"), progress=False) as g:
            for x in g:
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
            # (group, seq, op, kind, shape, ...): the raw entries, newest last.
            calls = [(e[1], e[2], list(e[4] or ())) for e in g.auditor.recent]
        Path(out, f"rank{rank}.json").write_text(json.dumps(calls))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow(reason="2 FSDP2 ranks (spawn)")
def test_fsdp2_collectives_are_audited(tmp_path):
    """FSDP2 issues its all-gathers and reduce-scatters through the torch.distributed
    module functions, so the auditor sees and compares them like any other call: 3 steps
    of a 2-layer model, 6 calls each. None of them is guardrails': the grad norm is
    global (DTensor), so the NaN flag needs no agreement, and guardrails' own
    agreements run on its side group, never the training's."""
    spawn(_fsdp2_rank, (free_port(), str(tmp_path)))
    calls = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert calls[0] == calls[1]  # same sequence, ops and shapes on both ranks
    ops = [op for _, op, _ in calls[0]]
    # torch 2.8's FSDP2 calls all_gather_into_tensor / reduce_scatter_tensor, 2.13's
    # the *_single functions (read in their sources); the auditor wraps all four.
    if "all_gather_single" in ops:
        gather, scatter = "all_gather_single", "reduce_scatter_single"
    else:
        gather, scatter = "all_gather_into_tensor", "reduce_scatter_tensor"
    per_step = [gather] * 4 + [scatter] * 2
    assert ops == per_step * 3, ops
    assert [seq for seq, _, _ in calls[0]] == list(range(1, 19))
