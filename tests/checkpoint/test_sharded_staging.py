"""FSDP2 background saves: the pinned staging memory guardrails allocates ahead of the
first save has exactly the structure DCP's own staging builds, and DCP copies into it."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from conftest import Regressor, batches, free_port, spawn

from guardrails.checkpoint.sharded import _empty_pinned

# Every test spawns its ranks (1 to 4, FSDP2 and DCP).
pytestmark = pytest.mark.slow(reason="spawns 1-4 FSDP2 ranks")


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = Regressor(depth=3)
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for x, y in batches(2, seed=rank):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        ours, theirs = _empty_pinned(state, pin=False), _create_cpu_state_dict(state)

        def describe(obj):
            if isinstance(obj, dict):
                return {k: describe(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return [describe(v) for v in obj]
            if isinstance(obj, DTensor):
                return (
                    "DTensor",
                    tuple(obj.shape),
                    obj.dtype,
                    tuple(obj.placements),
                    tuple(obj._local_tensor.shape),
                    obj._local_tensor.device.type,
                    obj.device.type,  # a host tensor in a DTensor that says so
                )
            if isinstance(obj, torch.Tensor):
                return ("Tensor", tuple(obj.shape), obj.dtype, obj.device.type)
            return obj

        def local(t):
            return t._local_tensor if isinstance(t, DTensor) else t

        def equal(copied):
            return all(
                torch.equal(local(a), local(b))
                for a, b in zip(_leaves(state), _leaves(copied), strict=True)
            )

        # Pinned, the tensors are views of one block locked in place; CUDA cannot lock
        # pages here, so the block is plain memory (hostmem.page_locked's CPU stand-in).
        from guardrails.checkpoint import hostmem

        hostmem.page_locked = lambda n: (torch.zeros(n, dtype=torch.uint8), True)
        locked: list[int] = []
        carved = _empty_pinned(state, locked=locked)
        staged = [local(t) for t in _leaves(carved) if t.dim() and local(t).numel()]
        blocks = {t.untyped_storage().data_ptr() for t in staged}
        result = {
            "ours": describe(ours),
            "theirs": describe(theirs),
            "carved": describe(carved),
            "copied_equal": equal(_copy_state_dict(state, ours)),
            "carved_equal": equal(_copy_state_dict(state, carved)),
            "blocks": len(blocks),
            "locked": len(locked),
            "n": len(_leaves(state)),
        }
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def _leaves(obj):
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _leaves(v)]
    return [obj] if isinstance(obj, torch.Tensor) else []


def test_staging_allocated_ahead_matches_dcps_and_takes_the_copy(tmp_path):
    spawn(_worker, (2, free_port(), str(tmp_path)))
    for rank in (0, 1):
        res = pickle.loads((tmp_path / f"rank{rank}.pkl").read_bytes())
        assert res["ours"] == res["theirs"] == res["carved"]
        assert res["copied_equal"] and res["n"] >= 3 * 6  # weights, exp_avg(_sq), steps
        assert res["carved_equal"] and res["blocks"] == res["locked"] == 1, res


def _writer_worker(rank: int, world: int, port: int, out: str) -> None:
    import threading

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from guardrails.checkpoint import sharded
    from guardrails.distributed import store as _store

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = {}
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 1))
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            model(torch.randn(8, 256)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        store = _store.side_store(0, "test")
        writer = sharded.ShardWriter()

        def write(name, staged, cancel=None):
            try:
                writer.write(
                    Path(out, name),
                    staged,
                    rank=rank,
                    world=world,
                    store=store,
                    key=name,
                    cancel=cancel or threading.Event(),
                    timeout_s=60,
                )
                return "written"
            except Exception as e:  # as the checkpointer sees them
                return f"{type(e).__name__}: {e}"

        staged = writer.stage(model, opt)
        result["first"] = write("first", staged)
        model_sd, optim_sd = get_state_dict(model, opt)
        result["model"] = {k: v.full_tensor() for k, v in model_sd.items()}
        result["exp_avg"] = {k: v["exp_avg"].full_tensor() for k, v in optim_sd["state"].items()}
        layout = writer._layout
        result["second"] = write("second", writer.stage(model, opt))  # the plan reused
        result["plan_reused"] = writer._layout is layout
        result["live"] = write("live", writer.live(model, opt))  # a signal save's shards
        # A layout of its own (an extra entry): planned again, not written by the old plan.
        result["changed"] = write("changed", {**writer.stage(model, opt), "extra": torch.ones(3)})
        cancel = threading.Event()
        cancel.set()  # a stop came before the writer got to any item
        result["abandoned"] = write("abandoned", writer.stage(model, opt), cancel)
        dist.barrier()
        if rank == 1:  # rank 1's disk fills up on its first item

            def full(planner, item):
                raise OSError(28, "No space left on device")

            sharded._item_data = full
        result["failed"] = write("failed", writer.stage(model, opt))
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def test_the_shard_writer_writes_what_stock_dcp_reads_and_fails_together(tmp_path):
    """FSDP2 saves are written by guardrails' ShardWriter, not dcp.async_save or dcp.save:
    its files are DCP's format (stock DCP converts them to one torch.save file, the full
    tensors equal the live ones), from staged shards (background saves) or the live
    ones (a signal's save), its plan and metadata are reused until the state's layout
    changes, a stop's cancel ends the write on every rank with no .metadata, and one rank's
    failure is an error naming that rank on the other (no wait for a timeout)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    spawn(_writer_worker, (2, free_port(), str(tmp_path)))
    res = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in (0, 1)]
    for r in res:
        assert (r["first"], r["second"], r["live"], r["changed"]) == ("written",) * 4, r
        assert r["plan_reused"]
        assert r["abandoned"].startswith("Cancelled"), r["abandoned"]
    assert res[1]["failed"].startswith("OSError") or "No space" in res[1]["failed"], res[1]
    assert res[0]["failed"].startswith("CheckpointError"), res[0]["failed"]
    assert "rank 1 could not write" in res[0]["failed"] and "No space" in res[0]["failed"]
    for name in ("first", "second", "live"):
        dcp_to_torch_save(tmp_path / name / "dcp", tmp_path / f"{name}.pt")
        full = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        for k, v in res[0]["model"].items():
            assert torch.equal(full["model"][k], v), (name, k)
        for k, v in res[0]["exp_avg"].items():
            assert torch.equal(full["optim"]["state"][k]["exp_avg"], v), (name, k)
    # Same layout, same item sizes: the second save wrote the first's .metadata again
    # (DCP's own finish would have written another save id and path into it).
    first, second = (tmp_path / n / "dcp" / ".metadata" for n in ("first", "second"))
    assert first.read_bytes() == second.read_bytes()
    changed = tmp_path / "changed"
    dcp_to_torch_save(changed / "dcp", tmp_path / "changed.pt")
    extra = torch.load(tmp_path / "changed.pt", weights_only=True)["extra"]
    assert torch.equal(extra, torch.ones(3))
    for name in ("abandoned", "failed"):
        assert not (tmp_path / name / "dcp" / ".metadata").exists(), name


def _alone_worker(rank: int, port: int, out: str) -> None:
    """One process, FSDP2 over a mesh of one: no side store, the writer plans alone."""
    import threading

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from guardrails.checkpoint import sharded
    from guardrails.distributed import store as _store

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        assert _store.side_store(0, "alone") is None  # as the checkpointer finds it
        writer = sharded.ShardWriter()
        records = writer.write(
            Path(out),
            writer.live(model, opt),
            rank=0,
            world=1,
            store=None,
            key="alone",
            cancel=threading.Event(),
            timeout_s=60,
        )
        model_sd, _ = get_state_dict(model, opt)
        full = {k: v.full_tensor() for k, v in model_sd.items()}
    finally:
        dist.destroy_process_group()
    Path(out, "result.pkl").write_bytes(pickle.dumps({"records": records, "model": full}))


def test_a_single_process_shard_writer_plans_alone(tmp_path):
    """FSDP2 on one process has no side store: the ShardWriter plans through a store of
    its own, and writes what stock DCP reads."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    spawn(_alone_worker, (free_port(), str(tmp_path)), nprocs=1)
    res = pickle.loads((tmp_path / "result.pkl").read_bytes())
    assert {".metadata", "__0_0.distcp"} <= set(res["records"]), res["records"]
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    for k, v in res["model"].items():
        assert torch.equal(full["model"][k], v), k


def _hsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    import threading

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from guardrails.checkpoint import sharded
    from guardrails.distributed import store as _store

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
        # HSDP: replicated across the first mesh dimension, sharded across the second.
        fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("r", "s")))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        writer = sharded.ShardWriter()
        records = writer.write(
            Path(out, "ckpt"),
            writer.stage(model, opt),
            rank=rank,
            world=world,
            store=_store.side_store(0, "hsdp"),
            key="s",
            cancel=threading.Event(),
            timeout_s=60,
        )
        model_sd, optim_sd = get_state_dict(model, opt)
        full = {k: v.full_tensor() for k, v in model_sd.items()}
        result = {"records": sorted(records), "full": full}
        # The same state through DCP's own save, for the bytes it writes.
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(Path(out, "dcp")))
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def test_hsdp_shards_replicated_across_groups_are_written_once(tmp_path):
    """HSDP on 4 gloo ranks (2 replicas of 2 shards): each shard is written by one rank
    of its replicas (as many bytes as DCP's own save writes), and stock DCP rebuilds
    every full tensor from the files."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    spawn(_hsdp_worker, (4, free_port(), str(tmp_path)), nprocs=4)
    res = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(4)]
    dcp_to_torch_save(tmp_path / "ckpt" / "dcp", tmp_path / "full.pt")
    saved = torch.load(tmp_path / "full.pt", weights_only=True)
    for k, v in res[0]["full"].items():
        assert torch.equal(saved["model"][k], v), k
    assert ".metadata" in res[0]["records"]
    # What is replicated across the two replicas is written once, as DCP's own save
    # does: the same bytes in all (written twice, it would be about twice as many).
    ours, theirs = (
        sum(f.stat().st_size for f in (tmp_path / d).glob("*.distcp")) for d in ("ckpt/dcp", "dcp")
    )
    assert theirs > 3 * 4 * 64 * 65 and ours == theirs, (ours, theirs)
