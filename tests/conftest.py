"""Shared helpers: small real models and loops. Nothing here mocks torch or the OS."""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

import pytest
import torch
from _ranks import cpu_now, free_port, patience, run_script, spawn  # noqa: F401  (tests import them)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from guardrails.metrics import events as events_file

# The tests live in folders that mirror the package (tests/engine, tests/guards...), and
# a few share a helper by module name (test_storage runs test_nan's poisoned loop): every
# folder is on the path, as the one flat folder was. Basenames stay unique across them.
_TESTS = Path(__file__).resolve().parent
sys.path[1:1] = sorted(str(d) for d in _TESTS.iterdir() if d.is_dir() and any(d.glob("test_*.py")))

# One intra-op thread per process, as torchrun sets for its ranks: the suite's
# processes (2-rank jobs, pytest-xdist workers) share CI's 2 cores, and OpenMP threads
# that spin-wait for a core slow everything down. Set before any test starts a process;
# a developer's own OMP_NUM_THREADS wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


class Regressor(nn.Module):
    """An MLP with ``depth`` hidden layers that returns its MSE loss (so the guard
    picks the loss up from the output) or, with ``return_loss=False``, predictions."""

    def __init__(self, depth: int = 2, width: int = 8, return_loss: bool = True) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(4, width), nn.Tanh()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.Tanh()]
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)
        self.return_loss = return_loss

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        pred = self.net(x).squeeze(-1)
        if y is None or not self.return_loss:
            return pred
        return nn.functional.mse_loss(pred, y)


def batches(n: int, batch: int = 8, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 4, generator=g), torch.randn(batch, generator=g)) for _ in range(n)]


class CountNorms(TorchDispatchMode):
    """Counts the passes over the gradients: each ``_foreach_norm`` (torch's clipping;
    the guard's own norm per tensor) and each ``cat`` (the guard's own norm of a small
    model on CPU, by one flat copy of the gradients) is one."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._foreach_norm.Scalar, torch.ops.aten.cat.default):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def reference_grad_norm(model: nn.Module) -> float:
    """Total L2 grad norm computed the plain way, one tensor at a time."""
    norms = [p.grad.double().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(norms).norm())


def train_loop(g, model, opt) -> None:
    """The plain loop over a guard's batches: ``model(x, y).backward()``, ``opt.step()``,
    ``opt.zero_grad()``, each step, to the end. A test whose point is inside the loop (a
    fault at step k, a signal, a collective) writes its loop out instead."""
    for x, y in g:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()


def guarded_run(run_dir, n_steps: int = 2, inside=None, **knobs):
    """Train a fresh seeded Regressor with SGD for ``n_steps`` under
    ``guardrails.guard(..., run_dir=run_dir, **knobs)``; ``inside(g)`` runs before the
    block closes. Returns the (closed) guard."""
    import guardrails

    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guardrails.guard(model, opt, batches(n_steps), run_dir=run_dir, **knobs) as g:
        train_loop(g, model, opt)
        if inside is not None:
            inside(g)
    return g


def run_worker(worker: Path, run_dir: Path, out: Path, *args: object):
    """``python WORKER RUN_DIR OUT ARGS...`` to its end (a worker script of the resume
    tests), forked from the fork server (``_ranks.run_script``): the finished process,
    its output captured."""
    return run_script([sys.executable, worker, run_dir, out, *args], timeout_s=240)


def read_events(run_dir) -> list[dict]:
    """Every event of ``run_dir``, its nodes' files merged by time: the one place the
    tests read events (the files' names are guardrails' business)."""
    return events_file.read_events(Path(run_dir))


def events_path(run_dir) -> Path:
    """The events file this host's ranks write (a test that tears or edits it)."""
    return events_file.events_path(Path(run_dir))


def assert_state_equal(a, b, path="state") -> None:
    """Nested state (dicts, lists, tensors, plain values) bitwise equal, naming the first
    path that differs: resumed runs against uninterrupted ones."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_state_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_state_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def pytest_collection_modifyitems(config, items) -> None:
    """The files with the most ``slow`` tests first, each file's tests together and in
    their order: under ``-n 2 --dist loadfile --no-loadscope-reorder`` the long files
    start first and the short ones fill in around them, rather than one worker running
    a long file alone at the end."""
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])


# ---------------------------------------------------------------- each test's CPU time
# ``--cpu-durations=N`` lists the N tests that used the most CPU-s (the test's process
# and the processes it started; ``_ranks.cpu_now``), as ``--durations`` lists wall
# time: on a shared machine the CPU time is what says whether a test is slow.


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--cpu-durations",
        type=int,
        default=None,
        metavar="N",
        help="list the N tests that used the most CPU-s (0: all), with their processes'",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.cpu_start = cpu_now()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown" and hasattr(item, "cpu_start"):
        outcome.get_result().user_properties.append(("cpu_s", cpu_now() - item.cpu_start))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    n = config.getoption("--cpu-durations")
    if n is None:
        return
    costs = [
        (dict(rep.user_properties)["cpu_s"], rep.nodeid)
        for reports in terminalreporter.stats.values()
        for rep in reports
        if getattr(rep, "when", None) == "teardown" and "cpu_s" in dict(rep.user_properties)
    ]
    costs.sort(reverse=True)
    terminalreporter.write_sep("=", f"CPU-s per test ({sum(c for c, _ in costs):.0f} in all)")
    for cpu_s, nodeid in costs[:n] if n else costs:
        terminalreporter.write_line(f"{cpu_s:8.2f}s cpu  {nodeid}")
