"""The error translator: torch / NCCL / gloo / CUDA failures explained with their
causes and fixes, by ``guardrails.explain`` and re-raised under ``guard``.

Where this machine can produce the real error (a port in use: a real TCPStore on a real
bound socket) the test does; the GPU / NCCL messages are matched on the text those
libraries print (quoted from torch 2.13's binaries and NCCL's logs)."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import Regressor, batches

import guardrails
from guardrails.guards.explain import SIGNATURES, match, translate


@pytest.fixture
def taken_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def _store_on(port: int) -> None:
    dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=5))


def test_a_real_address_in_use_is_explained(taken_port):
    with pytest.raises(Exception) as info:  # torch's DistNetworkError (a RuntimeError)
        _store_on(taken_port)
    text = guardrails.explain(info.value)
    assert text.startswith("the rendezvous port is already in use")
    assert "zombie" in text and "lsof -i" in text
    assert f"--master-port={taken_port + 1}" in text  # the port from torch's message
    assert f"pid {__import__('os').getpid()}" in text  # who holds it: this test


# (torch / NCCL / gloo text, expected family, key words of the explanation)
CASES = [
    (
        RuntimeError(
            "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42, "
            "OpType=ALLREDUCE, NumelIn=1024, NumelOut=1024, Timeout(ms)=600000) ran for "
            "600012 milliseconds before timing out."
        ),
        "HangError",
        ["deadlock", "data exhaustion", "tensor size mismatch", "nvidia-smi"],
    ),
    (
        RuntimeError(
            "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
            "waiting 1800000ms for recv operation to complete"
        ),
        "HangError",
        ["hang_timeout_s"],
    ),
    (
        RuntimeError(
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
            "[127.0.0.1]:41234: Connection reset by peer"
        ),
        "RankFailedError",
        ["a rank died", "first traceback"],
    ),
    (
        RuntimeError(
            "Received data size doesn't match expected size. Is there a distributed "
            "collective mismatch in your code?"
        ),
        "CollectiveMismatchError",
        ["same collectives in the same order", "rank 0"],
    ),
    (
        # torch 2.8's gloo says the same without naming the cause.
        RuntimeError(
            "[enforce fail at ../third_party/gloo/gloo/transport/tcp/pair.cc:446] "
            "op.preamble.length <= op.nbytes. 32 vs 4"
        ),
        "CollectiveMismatchError",
        ["same collectives in the same order", "rank 0"],
    ),
    (
        RuntimeError("CUDA error: invalid device ordinal\nCUDA kernel errors might be ..."),
        "LaunchError",
        ["CUDA_VISIBLE_DEVICES", "torchrun", "LOCAL_RANK"],
    ),
    (
        RuntimeError(
            "NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage, Duplicate GPU "
            "detected : rank 1 and rank 0 both on CUDA device 1000"
        ),
        "LaunchError",
        ["set_device"],
    ),
    (
        RuntimeError(
            "Expected to have finished reduction in the prior iteration before starting a "
            "new one. This error indicates that your module has parameters that were not "
            "used in producing loss."
        ),
        "GuardrailsError",
        ["find_unused_parameters=True", "requires_grad=False"],
    ),
    (
        RuntimeError("Timed out after 901 seconds waiting for clients. 1/2 clients joined."),
        "LaunchError",
        ["MASTER_ADDR", "WORLD_SIZE"],
    ),
]


@pytest.mark.parametrize(
    ("exc", "family", "words"), CASES, ids=lambda c: getattr(c, "__name__", None)
)
def test_signatures_are_explained_with_cause_and_fix(exc, family, words):
    text = guardrails.explain(exc)
    assert "likely cause" in text and "\n  fix: " in text
    for w in words:
        assert w in text, (w, text)
    err = translate(exc)
    assert type(err).__name__ == family
    assert isinstance(err, guardrails.GuardrailsError)
    assert err.hint and err.hint in text
    assert err.signature == match(exc).key


def test_cuda_oom_is_explained_but_left_to_memory_guard():
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    text = guardrails.explain(exc)
    assert "gradient checkpointing" in text and "FSDP" in text
    assert translate(exc) is None  # MemoryGuard re-raises OOMs with the memory summary


def test_child_failed_error_by_class_name():
    class ChildFailedError(Exception):  # torchrun's, by name; its text names no cause
        pass

    text = guardrails.explain(ChildFailedError("scripts.base_train FAILED"))
    assert "@guardrails.record" in text


def test_the_chain_is_searched():
    try:
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except ConnectionResetError as inner:
            raise RuntimeError("all_reduce failed") from inner
    except RuntimeError as outer:
        assert isinstance(translate(outer), guardrails.RankFailedError)


def test_unknown_errors_and_our_own_are_left_alone():
    assert guardrails.explain(ValueError("bad value")) == ""
    assert translate(ValueError("bad value")) is None
    ours = guardrails.HangError("stuck", rank=1)
    assert translate(ours) is None


def test_every_signature_has_a_cause_and_a_fix():
    keys = [s.key for s in SIGNATURES]
    assert len(keys) == len(set(keys))
    for s in SIGNATURES:
        assert s.causes and s.fix and s.patterns
        assert hasattr(guardrails, s.family) or s.family == "GuardrailsError"


def test_under_guard_the_error_is_replaced_chained_with_rank_and_step(tmp_path, taken_port):
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(guardrails.LaunchError) as info:
        with guardrails.guard(model, opt, batches(5), run_dir=tmp_path, metrics=False) as g:
            # Not train_loop: the port is taken at step 2, from inside the loop.
            for x, y in g:
                model(x, y).backward()
                opt.step()
                opt.zero_grad()
                if g.step == 2:
                    _store_on(taken_port)  # e.g. a second init on a port a run still holds
    err = info.value
    assert err.step == 2 and err.signature == "address_in_use"
    assert "after 2 optimizer step(s)" in str(err) and "phase: loop" in str(err)
    assert "EADDRINUSE" in str(err.__cause__) or "in use" in str(err.__cause__)
    assert err.hint and "--master-port" in err.hint


def test_under_guard_unknown_errors_pass_through(tmp_path):
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(KeyError, match="mine"):
        with guardrails.guard(model, opt, batches(2), run_dir=tmp_path, metrics=False) as g:
            for _ in g:
                raise KeyError("mine")
    off = guardrails.guard(model, opt, explain=False)
    assert not any(c.name == "explain" for c in off.components)
