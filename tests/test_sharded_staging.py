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
