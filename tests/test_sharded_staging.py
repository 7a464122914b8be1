"""FSDP2 background saves: the pinned staging memory guardrails allocates ahead of the
first save has exactly the structure DCP's own staging builds, and DCP copies into it."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch
from conftest import Regressor, batches, free_port, spawn

from guardrails._sharded import _empty_pinned


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
                )
            if isinstance(obj, torch.Tensor):
                return ("Tensor", tuple(obj.shape), obj.dtype, obj.device.type)
            return obj

        copied = _copy_state_dict(state, ours)
        same = all(
            torch.equal(
                a._local_tensor if isinstance(a, DTensor) else a,
                b._local_tensor if isinstance(b, DTensor) else b,
            )
            for a, b in zip(_leaves(state), _leaves(copied), strict=True)
        )
        result = {
            "ours": describe(ours),
            "theirs": describe(theirs),
            "copied_equal": same,
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
        assert res["ours"] == res["theirs"]
        assert res["copied_equal"] and res["n"] >= 3 * 6  # weights, exp_avg(_sq), steps


def _cancel_worker(rank: int, world: int, port: int, out: str) -> None:
    import threading

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from guardrails import _sharded

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = {}
    try:
        torch.manual_seed(0)
        # Data that outweighs DCP's per-item container (~2 KB an item): 790 KB with
        # AdamW's moments.
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 1))
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            model(torch.randn(8, 256)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        group = dist.new_group(backend="gloo")
        for name, cancelled in (("kept", False), ("abandoned", True)):
            cancel = threading.Event()
            if cancelled:  # a stop came before the writer got to any item
                cancel.set()
            target = Path(out, name)
            future = _sharded.save_async(target, model, opt, group, cancel=cancel)
            try:
                future.result(timeout=60)
                result[name] = "written"
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                result[name] = f"{type(e).__name__}: {e}"
            dist.barrier()
        dist.destroy_process_group(group)
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def test_a_cancelled_background_save_writes_nothing_more_on_every_rank(tmp_path, capfd):
    """A stop's save does not wait for an older background save still being written:
    once its cancel event is set, DCP's writers write every remaining item empty, on
    every rank, with no exception (no traceback from DCP's writer threads)."""
    spawn(_cancel_worker, (2, free_port(), str(tmp_path)))
    for rank in (0, 1):
        res = pickle.loads((tmp_path / f"rank{rank}.pkl").read_bytes())
        assert res == {"kept": "written", "abandoned": "written"}, res
    kept = sum(f.stat().st_size for f in (tmp_path / "kept" / "dcp").glob("*.distcp"))
    abandoned = sum(f.stat().st_size for f in (tmp_path / "abandoned" / "dcp").glob("*.distcp"))
    assert kept > 790_000 and abandoned < kept / 4, (kept, abandoned)
    assert "Traceback" not in capfd.readouterr().err
