"""Cross-rank preflight, even_batches and launch checks.

The multi-rank cases run in ONE pair of real gloo processes (spawning costs ~3 s a
pair on this box): each rank runs every scenario in order, each with its own guard
and run_dir, and records what came out; the tests then assert on both ranks' records.
A scenario that raises on one rank only would leave the other waiting in the next
scenario's exchange: the spawn has a deadline, so that fails the test instead of
hanging it.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from pathlib import Path

import pytest
import torch
from conftest import Regressor, batches, free_port, read_events, spawn, train_loop
from torch.utils.data import DataLoader, TensorDataset

import guardrails
from guardrails.distributed.launch import check_launch, launch_problems

# ---------------------------------------------------------------------- scenarios


def _loop(model, opt, data, run_dir, **knobs):
    with guardrails.guard(
        model,
        opt,
        data,
        run_dir=run_dir,
        metrics=False,
        checkpoint={"save_on_signal": False},
        **knobs,
    ) as g:
        train_loop(g, model, opt)
    return {"steps": g.step}


def _seeded(seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = Regressor().to(dtype)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _loader(n: int, batch_size: int, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, generator=g))
    return DataLoader(data, batch_size=batch_size)


def sc_clean(rank, d):
    return _loop(*_seeded(), _loader(32, 8, seed=rank), d, config={"lr": 0.1})


def sc_seeds(rank, d):
    return _loop(*_seeded(seed=rank), _loader(32, 8), d)


def sc_dataset_len(rank, d):
    return _loop(*_seeded(), _loader(64 if rank == 0 else 40, 8), d)


def sc_batch_size(rank, d):
    # 64 samples in 8s and 32 in 4s: both 8 batches, so only the batch size differs.
    return _loop(*_seeded(), _loader(64, 8) if rank == 0 else _loader(32, 4), d)


def sc_first_batch(rank, d):
    # Plain lists: no batch_size attribute; the first batch's shape tells.
    return _loop(*_seeded(), batches(3, batch=8 if rank == 0 else 6), d)


def sc_dtype(rank, d):
    dtype = torch.float32 if rank == 0 else torch.float64
    data = [(x.to(dtype), y.to(dtype)) for x, y in batches(3)]
    return _loop(*_seeded(dtype=dtype), data, d)


def sc_config(rank, d):
    config = {"lr": 3e-4 if rank == 0 else 1e-3, "data": {"dir": "/data/climbmix"}}
    return _loop(*_seeded(), _loader(32, 8), d, config=config)


def sc_optimizer(rank, d):
    model, _ = _seeded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1 if rank else 0.0)
    return _loop(model, opt, _loader(32, 8), d)


def sc_even_len(rank, d):
    return _loop(
        *_seeded(), _loader(40 if rank == 0 else 24, 8), d, preflight={"even_batches": True}
    )


def sc_even_nolen(rank, d):
    def gen(n):
        yield from batches(n, seed=rank)

    return _loop(*_seeded(), gen(20 if rank == 0 else 18), d, preflight={"even_batches": True})


def sc_empty(rank, d):
    def gen(n):
        yield from batches(n)

    return _loop(*_seeded(), gen(3 if rank == 0 else 0), d)


def sc_world_size_env(rank, d):
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = "3"  # as if init_process_group got world_size=2 by hand
    try:
        return _loop(*_seeded(), _loader(16, 8), d)
    finally:
        if saved is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved


def sc_explained(rank, d):
    """A real torch error (a store on a port still held) after real collectives: the
    translator names the rank, the step and the last collective."""
    from datetime import timedelta

    import torch.distributed as dist

    model, opt = _seeded()
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    try:
        with guardrails.guard(
            model, opt, batches(4), run_dir=d, metrics=False, checkpoint={"save_on_signal": False}
        ) as g:
            for x, y in g:
                model(x, y).backward()
                for p in model.parameters():
                    dist.all_reduce(p.grad)  # hand-rolled data parallel, audited
                opt.step()
                opt.zero_grad()
                if g.step == 2:
                    port = held.getsockname()[1]
                    dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=5))
    finally:
        held.close()
    return {"steps": g.step}


SCENARIOS = {name[3:]: fn for name, fn in globals().copy().items() if name.startswith("sc_")}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for name, fn in SCENARIOS.items():
            run_dir = Path(out) / name
            t0 = time.perf_counter()
            try:
                results[name] = fn(rank, run_dir)
            except guardrails.GuardrailsError as exc:
                results[name] = {
                    "error": type(exc).__name__,
                    "message": str(exc),
                    "fields": getattr(exc, "fields", None),
                    "check": getattr(exc, "check", None),
                    "ranks": getattr(exc, "ranks", None),
                    "rank": exc.rank,
                }
            results[name]["seconds"] = time.perf_counter() - t0
    finally:
        Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(results))
        dist.destroy_process_group()


#: The tests that read the shared two-rank fixture (every scenario, spawned once).
two_ranks = pytest.mark.slow(reason="reads the shared two-rank fixture: 2 spawned ranks")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out = tmp_path_factory.mktemp("preflight")
    spawn(_worker, (2, free_port(), str(out)))
    ranks = [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    return {name: (ranks[0][name], ranks[1][name], out / name) for name in SCENARIOS}


def _both_raise(outcomes, name, error="ConfigMismatchError"):
    r0, r1, _ = outcomes[name]
    for r, res in enumerate((r0, r1)):
        assert res.get("error") == error, (name, r, res)
        assert res["rank"] == r
    assert r0["fields"] == r1["fields"]  # the same decision on every rank
    return r0, r1


@two_ranks
def test_clean_run_passes_and_records_the_exchange(outcomes):
    r0, r1, run_dir = outcomes["clean"]
    assert r0.get("error") is None and r1.get("error") is None, (r0, r1)
    assert r0["steps"] == r1["steps"] == 4
    events = [e for e in read_events(run_dir) if e["kind"] == "preflight"]
    assert events and events[0]["seconds"] < 5


@two_ranks
def test_different_seeds_name_the_weights_and_the_ranks(outcomes):
    r0, _ = _both_raise(outcomes, "seeds")
    assert set(r0["fields"]) == {"params.weights"}
    assert set(r0["fields"]["params.weights"]) == {0, 1}
    assert "first differing tensor: net.0.weight" in r0["message"]
    assert r0["ranks"] == [1]
    assert "torch.manual_seed" in r0["message"]


@two_ranks
def test_different_dataset_length_names_the_loader_length(outcomes):
    r0, _ = _both_raise(outcomes, "dataset_len")
    assert r0["fields"]["loader.len"] == {0: 8, 1: 5}
    assert r0["fields"]["loader.dataset_len"] == {0: 64, 1: 40}
    assert '"even_batches": True' in r0["message"] and "DistributedSampler" in r0["message"]


@two_ranks
def test_different_batch_size_is_named(outcomes):
    r0, _ = _both_raise(outcomes, "batch_size")
    # Same number of batches: the dataset lengths alone would be harmless.
    assert set(r0["fields"]) == {"loader.batch_size"}
    assert r0["fields"]["loader.batch_size"] == {0: 8, 1: 4}
    assert "loader.batch_size: rank 0: 8; rank 1: 4" in r0["message"]


@two_ranks
def test_first_batch_shape_is_compared_at_the_first_batch(outcomes):
    r0, _ = _both_raise(outcomes, "first_batch")
    assert set(r0["fields"]) == {"first_batch"}
    assert "float32[8, 4]" in r0["fields"]["first_batch"][0]
    assert "float32[6, 4]" in r0["fields"]["first_batch"][1]


@two_ranks
def test_different_dtype_names_the_parameters_and_the_compute_dtype(outcomes):
    r0, _ = _both_raise(outcomes, "dtype")
    assert r0["fields"]["compute.param_dtypes"] == {0: ["float32"], 1: ["float64"]}
    assert r0["fields"]["params[net.0.weight]"] == {0: "(8, 4) float32", 1: "(8, 4) float64"}
    assert "compute dtype" in r0["message"]


@two_ranks
def test_user_config_is_compared_key_by_key(outcomes):
    r0, _ = _both_raise(outcomes, "config")
    assert set(r0["fields"]) == {"config.lr"}
    assert r0["fields"]["config.lr"] == {0: 3e-4, 1: 1e-3}


@two_ranks
def test_optimizer_hyperparameters_are_compared(outcomes):
    r0, _ = _both_raise(outcomes, "optimizer")
    assert set(r0["fields"]) == {"optimizer.weight_decay"}


@two_ranks
def test_even_batches_stops_every_rank_at_the_shortest(outcomes):
    r0, r1, run_dir = outcomes["even_len"]
    assert r0.get("error") is None and r1.get("error") is None, (r0, r1)
    assert r0["steps"] == r1["steps"] == 3  # 5 and 3 batches
    uneven = [e for e in read_events(run_dir) if e["kind"] == "uneven_data"]
    assert uneven and "after 3 batches" in uneven[0]["message"]


@two_ranks
def test_even_batches_without_len_agrees_in_chunks(outcomes):
    r0, r1, _ = outcomes["even_nolen"]
    assert r0.get("error") is None and r1.get("error") is None, (r0, r1)
    assert r0["steps"] == r1["steps"] == 18  # 20 and 18 batches, chunks of 16


@two_ranks
def test_an_empty_loader_on_one_rank_does_not_leave_the_other_waiting(outcomes):
    r0, _ = _both_raise(outcomes, "empty")
    assert "empty" in r0["fields"]["first_batch"][1]


@two_ranks
def test_world_size_env_against_the_process_group_is_a_launch_error(outcomes):
    r0, r1 = _both_raise(outcomes, "world_size_env", error="LaunchError")
    assert r0["check"] == r1["check"] == "world_size"
    assert "WORLD_SIZE=3" in r0["message"] and "2 ranks" in r0["message"]


@two_ranks
def test_a_real_torch_error_is_explained_with_rank_step_and_last_collective(outcomes):
    r0, r1, _ = outcomes["explained"]
    for r, res in enumerate((r0, r1)):
        assert res.get("error") == "LaunchError", res
        text = res["message"]
        assert f"rank {r} of 2" in text and "after 2 optimizer step(s)" in text
        # The loop's own last all_reduce (guardrails' flag agreement is not the user's).
        assert "last collective: all_reduce" in text and "test_preflight.py" in text
        assert "lsof -i :" in text and "--master-port=29501" not in text  # the real port
        assert "rendezvous port is already in use" in text and "--master-port" in text


# ---------------------------------------------------------------------- launch, one process


@pytest.fixture
def listening():
    """A real socket listening on a free port, as a leftover run would hold it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def test_master_port_in_use_names_the_holder_and_the_fix(listening):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(listening), "RANK": "0"}
    with pytest.raises(guardrails.LaunchError) as info:
        check_launch(env=env, device_type="cpu")
    err = info.value
    assert err.check == "master_port"
    assert f"pid {os.getpid()}" in str(err)  # this process holds it
    assert f"--master-port={listening + 1}" in err.hint


def test_port_held_is_fine_under_torchrun_and_on_other_ranks(listening):
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(listening), "RANK": "0"}
    # torchrun's agent holds MASTER_PORT on purpose; a worker rank does not host it.
    assert launch_problems(env={**base, "TORCHELASTIC_RUN_ID": "x"}, device_type="cpu") == []
    assert launch_problems(env={**base, "RANK": "1", "WORLD_SIZE": "2"}, device_type="cpu") == []


def test_free_port_passes():
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0"}
    assert check_launch(env=env, device_type="cpu") == []


def test_local_rank_past_the_visible_gpus_explains_invalid_device_ordinal():
    env = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "1"}
    with pytest.raises(guardrails.LaunchError) as info:
        check_launch(env=env, device_type="cuda", device_count=1)
    text = str(info.value)
    assert info.value.check == "local_rank"
    assert "invalid device ordinal" in text and "set per process" in text
    # Not known to be a CUDA job: only a warning (a gloo CPU job on a 1-GPU host is fine).
    problems = check_launch(env=env, device_count=1)
    assert [p.level for p in problems] == ["warning"]
    assert launch_problems(env=env, device_type="cpu", device_count=1) == []


def test_cuda_job_without_visible_gpu_is_named():
    with pytest.raises(guardrails.LaunchError) as info:
        check_launch(
            env={"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": ""}, device_type="cuda", device_count=0
        )
    assert info.value.check == "cuda_visible_devices"


def test_inconsistent_rank_variables_are_named():
    with pytest.raises(guardrails.LaunchError, match="RANK=2 but WORLD_SIZE=2"):
        check_launch(env={"RANK": "2", "WORLD_SIZE": "2"}, device_type="cpu")
    with pytest.raises(guardrails.LaunchError, match="LOCAL_RANK=2 but LOCAL_WORLD_SIZE=2"):
        check_launch(env={"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, device_type="cpu")


def test_master_addr_loopback_on_another_node_and_unresolvable():
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "GROUP_RANK": "1"}
    with pytest.raises(guardrails.LaunchError, match="loopback") as info:
        check_launch(env=env, device_type="cpu")
    assert info.value.check == "master_addr"
    # .invalid never resolves (RFC 6761).
    bad = {"MASTER_ADDR": "rank0.invalid", "MASTER_PORT": "29500", "RANK": "1"}
    with pytest.raises(guardrails.LaunchError, match="does not resolve"):
        check_launch(env=bad, device_type="cpu")


def test_preflight_is_a_no_op_in_one_process(tmp_path):
    from guardrails.guards.preflight.preflight import Preflight

    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guardrails.guard(model, opt, batches(2), run_dir=tmp_path, metrics=False) as g:
        train_loop(g, model, opt)
    pre = next(c for c in g.components if isinstance(c, Preflight))
    assert pre.seconds is None and g._batch_wrappers == []
    assert not any(e["kind"] == "preflight" for e in read_events(tmp_path))
    with pytest.raises(TypeError, match="config must be a mapping"):
        guardrails.guard(model, opt, config=["lr", 1])


def test_bf16_on_a_cpu_without_native_bf16_is_a_warning(tmp_path):
    from guardrails.util.probes import cpu_info

    torch.manual_seed(0)
    model = Regressor().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(x.bfloat16(), y.bfloat16()) for x, y in batches(1)]
    _loop(model, opt, data, tmp_path)
    warned = [e for e in read_events(tmp_path) if e["kind"] == "bf16_on_cpu"]
    # This machine's own CPU decides (read from /proc/cpuinfo, as doctor does).
    assert bool(warned) == (cpu_info()["bf16_native"] is False)
    if warned:
        assert warned[0]["level"] == "warning" and "float32" in warned[0]["message"]
