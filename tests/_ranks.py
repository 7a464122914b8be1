"""Real multi-rank jobs for the tests: N real processes, gloo, a free port, torchrun's
environment variables, a deadline, and nothing left running afterwards.

    job = launch([sys.executable, WORKER, "sleep", "--out", str(out)], out=out)
    ranks = job.wait(timeout_s=120)          # or: ranks = run_ranks(argv, out=out)
    ranks[1].code, ranks[1].out, ranks[1].error, ranks[1].ended

Each rank is its own process (so each ends on its own, as under a launcher that does not
kill the others) in its own session, with RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (rank 0 hosts the store, as with
``init_method="env://"``) and OMP_NUM_THREADS=1 set as torchrun sets them (a world of
1 is a plain process: none of them), and, with ``error_files=True``, its own
TORCHELASTIC_ERROR_FILE (``OUT/error<R>.json``). Its stdout and stderr go to files in
``OUT`` (``rank<R>.out`` / ``rank<R>.err``, or both in ``rank<R>.out``), never pipes, so
a chatty rank cannot block on a full pipe while the test waits on another. ``argv`` may
hold the arguments ``{rank}``, ``{world}`` and ``{port}``, or be a function of the rank. Past the
deadline every process group still running is SIGKILLed (a DataLoader worker or a
torchrun child with it) and the test fails, naming the ranks and their last output.

``spawn`` is the in-process form (``torch.multiprocessing``) for a module-level
function: its ranks are forked from a fork server that imported torch once, each with
the caller's environment, as a spawned process; ``torchrun`` runs one command under
``torch.distributed.run``.
Nothing is mocked: real processes, real gloo, real signals.

Every deadline here, and every wait of the tests on a process (``subprocess.run``'s
``timeout``, a poll's deadline), goes through ``patience``: the seconds a test names are
what it needs on an idle machine, stretched on a busy one (the load per core) and by
``GUARDRAILS_TEST_PATIENCE``. A hang still fails, later; guardrails' own knobs
(``hang_timeout_s``, ``grace_s``) and the bounds the tests assert on them never stretch.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

#: Variables a launcher (or a developer's shell) may have set that must not leak into
#: a test's ranks: the harness sets its own.
LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_RUN_ID",
)


#: Multiplies every wait of the test harness (``patience``); default 1. For a machine
#: slower than its load shows (a throttled VM, a debugger, coverage): e.g. 3.
PATIENCE_VAR = "GUARDRAILS_TEST_PATIENCE"


#: The most the machine's load stretches a wait: a hung test still fails within 4x its
#: idle-machine bound (GUARDRAILS_TEST_PATIENCE stretches further, by hand).
MAX_STRETCH = 4.0


def patience(seconds: float) -> float:
    """How long to wait for what takes up to ``seconds`` on an idle machine: ``seconds``
    times the load per core (the 1-minute load average over the cores, read now) where
    that is above 1, at most ``MAX_STRETCH`` times, times ``GUARDRAILS_TEST_PATIENCE``
    (default 1): with a load of 6 on 2 cores a 120 s wait is 360 s. The load only
    stretches a wait: a real hang still fails, later (at most 4x later unless the
    variable says otherwise)."""
    raw = os.environ.get(PATIENCE_VAR, "").strip() or "1"
    try:
        factor = float(raw)
    except ValueError:
        factor = -1.0
    if not factor > 0:
        raise ValueError(f"{PATIENCE_VAR}={raw!r}: expected a number above 0 (default 1)")
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    return seconds * min(MAX_STRETCH, max(1.0, load)) * factor


# Ports for MASTER_PORT come from below Linux's ephemeral range (32768-60999 by
# default), not from bind(port 0): a port from that range, free when picked, was taken
# seconds later as the *source* port of another rank's outgoing connection before its
# job's rank 0 could listen on it (seen in CI: EADDRINUSE with 13 jobs starting side by
# side). Each pytest-xdist worker draws from its own slice, and a port is never handed
# out twice in one process.
_PORT_LO, _PORT_SLICE = 20000, 3000
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, outside the ephemeral range and not
    handed out before by this process, for a test's MASTER_PORT."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    lo = _PORT_LO + (int(worker) % 4 if worker.isdigit() else 0) * _PORT_SLICE
    start = lo + (os.getpid() * 7) % _PORT_SLICE  # two sessions on one host: apart
    for i in range(_PORT_SLICE):
        port = lo + (start - lo + i) % _PORT_SLICE
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {lo}-{lo + _PORT_SLICE - 1}")


def base_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables, the repository and
    tests/ importable; then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    path = [str(ROOT), str(TESTS), *filter(None, [env.get("PYTHONPATH")])]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.update(extra)
    return env


def rank_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """torchrun's variables for ``rank`` of ``world`` on this host, and one intra-op
    thread per rank (as torchrun sets: the ranks share the cores); ``world`` 1 is a
    plain process (``python train.py``): none of them."""
    if world == 1:
        return base_env(**extra)
    ours = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    if "LOCAL_WORLD_SIZE" in extra:  # simulated nodes, as torchrun numbers them
        ours["LOCAL_RANK"] = str(rank % int(extra["LOCAL_WORLD_SIZE"]))
    return base_env(**{**ours, **extra})  # ``extra`` wins


@dataclass
class RankResult:
    """One rank's outcome: exit code (negative: the signal that ended it), its output,
    when it was seen to end (``time.time()``; None if it was killed at the deadline),
    the torchelastic error file it wrote (parsed; None if none) and the job's folder."""

    rank: int
    code: int | None
    out: str
    err: str
    ended: float | None
    error: dict | None
    dir: Path

    @property
    def text(self) -> str:
        """stdout and stderr together (for assertion messages and key words)."""
        return self.out + self.err

    def json(self, name: str) -> dict | None:
        """A result file the rank wrote into the job's folder (``name`` may hold
        ``{rank}``); None if it wrote none."""
        path = self.dir / name.format(rank=self.rank)
        return json.loads(path.read_text()) if path.exists() else None


@dataclass
class Job:
    """Ranks started by ``launch``: ``wait`` for them; leaving a ``with`` block (or a
    failed ``wait``) kills whatever still runs."""

    procs: list[subprocess.Popen | Forked]
    dir: Path
    merged: bool
    ended: dict[int, float] = field(default_factory=dict)

    def poll(self) -> bool:
        """Note the ranks that ended since the last call; True once all have."""
        now = time.time()
        for r, p in enumerate(self.procs):
            if r not in self.ended and p.poll() is not None:
                self.ended[r] = now
        return len(self.ended) == len(self.procs)

    def kill(self) -> list[int]:
        """SIGKILL every rank still running, with its process group (its DataLoader
        workers, a torchrun's children); returns the ranks that were still running."""
        late = [r for r, p in enumerate(self.procs) if p.poll() is None]
        for r in late:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.procs[r].pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
        return late

    def results(self) -> list[RankResult]:
        out = []
        for r, p in enumerate(self.procs):
            err_file = self.dir / f"error{r}.json"
            out.append(
                RankResult(
                    rank=r,
                    code=p.returncode,
                    out=_read(self.dir / f"rank{r}.out"),
                    err="" if self.merged else _read(self.dir / f"rank{r}.err"),
                    ended=self.ended.get(r),
                    error=json.loads(err_file.read_text()) if err_file.exists() else None,
                    dir=self.dir,
                )
            )
        return out

    def wait(self, timeout_s: float = 120.0, *, fail: bool = True) -> list[RankResult]:
        """Wait up to ``patience(timeout_s)`` for every rank (polling, to time when each
        ended). Ranks still running then are killed and, with ``fail``, the test fails."""
        wait_all({"job": self}, timeout_s, fail=fail)
        return self.results()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


#: ``GUARDRAILS_TEST_FORKSERVER=0`` starts every ``python SCRIPT`` of the tests as a real
#: new interpreter, as before the fork server (to rule the server out of a failure).
FORKSERVER_VAR = "GUARDRAILS_TEST_FORKSERVER"

#: Environment variables an interpreter or torch may read as it starts (hash seed,
#: warnings, threads, devices, libraries): a fork server is started with them, and
#: serves only the processes launched with the same values.
_STARTUP_VARS = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "CUDA", "LD_", "HIP")


def _startup_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` read at start-up, but PYTHONPATH (the fork server
    builds each child's ``sys.path`` from its own) and TORCHELASTIC_* (torchrun's, read
    later, by guardrails and torch.distributed)."""
    return {
        k: v
        for k, v in env.items()
        if k.startswith(_STARTUP_VARS) and not k.startswith("TORCHELASTIC_") and k != "PYTHONPATH"
    }


def _inherited() -> dict:
    """What a process inherits from the one that starts it, besides its environment
    and directory, read from this one now (a test may have changed them): the umask,
    the resource limits, the CPUs it may run on, its nice value."""
    umask = os.umask(0o22)
    os.umask(umask)
    return {
        "umask": umask,
        "rlimits": {
            name: resource.getrlimit(getattr(resource, name))
            for name in dir(resource)
            if name.startswith("RLIMIT_")
        },
        "cpus": sorted(os.sched_getaffinity(0)),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
    }


class Forked:
    """A ``python SCRIPT`` process forked by the fork server: a real process of its own
    (its pid, its session; signals and ``killpg`` reach it), with the part of
    ``subprocess.Popen``'s interface the tests use. Its exit status comes from the
    server, which is its parent; ``returncode`` is negative for a death by signal, and
    ``cpu_s`` the CPU time it used (with the children it reaped)."""

    #: The CPU-s of every forked process seen to end in this pytest process: they are
    #: not this process's children, so ``RUSAGE_CHILDREN`` misses them (``cpu_now``).
    ended_cpu_s = 0.0

    def __init__(
        self, args: list[str], conn: socket.socket, pid: int, buf: bytes, log: Path
    ) -> None:
        self.args, self.pid, self.returncode, self.cpu_s = args, pid, None, 0.0
        self._conn, self._buf, self.log = conn, buf, log
        self.server: ForkServer | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_status(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._read_status(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read_status(self, timeout: float | None) -> bool:
        line = _read_line(self._conn, self, timeout)
        if line is None:
            return False
        kind, _, rest = line.partition(" ")
        if kind != "status":
            raise RuntimeError(f"fork server: {line} (for {self.args})")
        status, cpu_s = rest.split()
        self.returncode = os.waitstatus_to_exitcode(int(status))
        self.cpu_s = float(cpu_s)
        Forked.ended_cpu_s += self.cpu_s
        if self.server is not None:
            self.server.live.discard(self.pid)
        self._conn.close()
        return True


def _read_line(conn: socket.socket, holder, timeout: float | None) -> str | None:
    """The next line from the server (buffered in ``holder._buf``), waiting up to
    ``timeout`` seconds (None: for ever); None if none came in time."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while b"\n" not in holder._buf:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([conn], [], [], left)[0]:
            return None
        chunk = conn.recv(4096)
        if not chunk:
            raise RuntimeError(f"the fork server went away (its log: {holder.log})")
        holder._buf += chunk
    line, _, holder._buf = holder._buf.partition(b"\n")
    return line.decode()


#: The longest the server may take to start (it imports torch: ~4 s on an idle core) or
#: to answer; not shortened by a test that sets a small GUARDRAILS_TEST_PATIENCE to
#: time its own process out.
SERVER_WAIT_S = 120.0


class ForkServer:
    """The client of ``tests/_forkserver.py``: a server per pytest process (each xdist
    worker) and set of start-up variables (``_STARTUP_VARS``), started at the first
    ``python SCRIPT`` launched with them, ended when the process exits (or earlier,
    past ``MAX_SERVERS``). A process launched with other
    start-up variables than the servers' gets a server of its own, started with them:
    what it would see fresh, forked. ``serves`` says which commands a server takes;
    ``for_env`` gives the server; ``start`` forks one."""

    #: Servers held at once per pytest process (~400 MB each, mostly shared with their
    #: children), past which the least recently used one with nothing running ends: a
    #: test that sets a start-up variable for its processes starts one more, and
    #: torch.compile in a test's own process sets TORCHINDUCTOR_CACHE_DIR for every
    #: later launch of that pytest process.
    MAX_SERVERS = 3

    _servers: ClassVar[dict[tuple, ForkServer]] = {}
    _owner = os.getpid()

    def __init__(self, startup: dict[str, str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="guardrails-forkserver-"))
        self.socket = str(self.dir / "socket")
        env = {k: v for k, v in base_env().items() if k not in _startup_env(base_env())}
        with open(self.dir / "server.log", "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(TESTS / "_forkserver.py"), self.socket],
                cwd=ROOT,
                env={**env, **startup},
                stdin=subprocess.PIPE,  # its end of the pipe closing ends the server
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.live: set[int] = set()  # the pids it forked, not yet seen to end
        atexit.register(self.close)

    @classmethod
    def for_env(cls, env: dict[str, str]) -> ForkServer:
        """The server for a process with environment ``env``: started now if none has
        its start-up variables."""
        if cls._owner != os.getpid():  # a process forked from this one: none of its own
            cls._servers, cls._owner = {}, os.getpid()
        key = tuple(sorted(_startup_env(env).items()))
        server = cls._servers.pop(key, None) or cls(_startup_env(env))
        cls._servers[key] = server  # the most recently used last
        idle = [k for k, other in cls._servers.items() if not other.live and other is not server]
        for k in idle[: max(0, len(cls._servers) - cls.MAX_SERVERS)]:
            cls._servers.pop(k).close()  # it forked nothing still running: nothing lost
        return server

    @classmethod
    def get(cls) -> ForkServer:
        """The server for a process with this process's environment."""
        return cls.for_env(base_env())

    @staticmethod
    def serves(cmd: Sequence[str]) -> bool:
        """A command of the form ``python SCRIPT.py ...``, ``python -c CODE ...`` or
        ``python -m MODULE ...`` (this interpreter, no other flag), unless
        ``GUARDRAILS_TEST_FORKSERVER=0``."""
        if os.environ.get(FORKSERVER_VAR, "1").strip() == "0":
            return False
        if len(cmd) < 2 or cmd[0] != sys.executable:
            return False
        return cmd[1].endswith(".py") or (cmd[1] in ("-c", "-m") and len(cmd) > 2)

    def start(
        self, cmd: list[str], env: dict, cwd: Path, out_fd: int, err_fd: int
    ) -> Forked | None:
        """Fork ``cmd`` with its output on ``out_fd``/``err_fd``; None when the server
        cannot fork now (the caller starts a real process instead)."""
        conn = self._connect()
        request = {"argv": cmd, "env": env, "cwd": str(cwd), **_inherited()}
        request = json.dumps(request).encode()
        socket.send_fds(conn, [struct.pack("!I", len(request)) + request], [out_fd, err_fd])
        holder = Forked(cmd, conn, 0, b"", self.dir / "server.log")
        line = _read_line(conn, holder, max(SERVER_WAIT_S, patience(SERVER_WAIT_S)))
        kind, _, value = (line or "error no answer in time").partition(" ")
        if kind != "pid":
            conn.close()
            return None
        holder.pid = int(value)
        holder.server = self
        self.live.add(holder.pid)
        return holder

    def _connect(self) -> socket.socket:
        """A connection to the server, waiting for it to start (it imports torch)."""
        deadline = time.monotonic() + max(SERVER_WAIT_S, patience(SERVER_WAIT_S))
        while True:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(self.socket)
                return conn
            except (FileNotFoundError, ConnectionRefusedError):
                conn.close()
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.dir / "server.log").read_text(errors="replace")
                    raise RuntimeError(f"the fork server did not start:\n{log[-3000:]}") from None
                time.sleep(0.05)

    def close(self) -> None:
        """End the server (it kills what it still runs) and reap it, so its CPU time
        counts in this process's children's."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # type: ignore[union-attr]
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)


def cpu_now() -> float:
    """CPU-s used so far by this process and the processes it started that ended:
    its own, its reaped children's, and those forked for it by the fork server (the
    ranks ``spawn`` forks are not counted). A test's cost, read before and after it,
    whatever else the machine runs."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    return used + Forked.ended_cpu_s


def run_script(
    argv: Sequence[str | os.PathLike],
    *,
    timeout_s: float,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=...)`` for a
    ``python SCRIPT ...``, forked from the fork server unless ``fresh``; ``env``
    defaults to this process's, as for ``subprocess.run``. Output comes through pipes
    (as ``capture_output``: a file could be refused under a test's RLIMIT_FSIZE); past
    ``patience(timeout_s)`` the process group is killed and ``subprocess.TimeoutExpired``
    raised."""
    cmd = [str(a) for a in argv]
    env = dict(os.environ) if env is None else env
    cwd = Path.cwd() if cwd is None else cwd
    limit = patience(timeout_s)
    if fresh or not ForkServer.serves(cmd):
        return subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env, cwd=cwd)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        proc = ForkServer.for_env(env).start(cmd, env, cwd, out_w, err_w)
    finally:
        os.close(out_w)
        os.close(err_w)
    if proc is None:
        os.close(out_r)
        os.close(err_r)
        return subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env, cwd=cwd)
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    open_fds, deadline = [out_r, err_r], time.monotonic() + limit
    try:
        while open_fds:  # to EOF on both, as communicate() reads
            left = deadline - time.monotonic()
            ready = select.select(open_fds, [], [], max(0.0, left))[0]
            if not ready:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                raise subprocess.TimeoutExpired(cmd, limit)
            for fd in ready:
                data = os.read(fd, 65536)
                if data:
                    chunks[fd].append(data)
                else:
                    open_fds.remove(fd)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        os.close(out_r)
        os.close(err_r)
    text = {fd: b"".join(c).decode(errors="replace") for fd, c in chunks.items()}
    return subprocess.CompletedProcess(cmd, code, text[out_r], text[err_r])


def _fail(message: str) -> None:
    import pytest  # not at the top: the workers import conftest, so this module, too

    pytest.fail(message)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _start(
    cmd: list[str], env: dict[str, str], out: Path, name: str, merge: bool, cwd: Path, fresh: bool
) -> subprocess.Popen | Forked:
    with open(out / f"{name}.out", "w") as stdout:
        stderr = subprocess.STDOUT if merge else open(out / f"{name}.err", "w")  # noqa: SIM115
        try:
            if not fresh and ForkServer.serves(cmd):
                err = stdout if merge else stderr
                server = ForkServer.for_env(env)
                forked = server.start(cmd, env, cwd, stdout.fileno(), err.fileno())
                if forked is not None:
                    return forked
            return subprocess.Popen(
                cmd,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,  # killpg reaches its children
            )
        finally:
            if stderr is not subprocess.STDOUT:
                stderr.close()


def launch(
    argv: Sequence[str | os.PathLike] | Callable[[int], Sequence[str | os.PathLike]],
    world: int = 2,
    *,
    out: Path,
    env: dict[str, str] | None = None,
    port: int | None = None,
    cwd: Path = ROOT,
    merge: bool = True,
    error_files: bool = False,
    fresh: bool = False,
) -> Job:
    """Start ``world`` ranks of ``argv`` (see the module's docstring); ``env`` is added
    to each rank's environment. A ``python SCRIPT ...`` rank is forked from the fork
    server (``ForkServer``: torch imported once) unless ``fresh`` asks for a new
    interpreter (a test about the interpreter's start-up itself)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port() if port is None else port
    job = Job([], out, merge)
    try:
        for r in range(world):
            args = argv(r) if callable(argv) else argv
            fill = {"{rank}": r, "{world}": world, "{port}": port}
            cmd = [str(fill.get(str(a), a)) for a in args]
            extra = dict(env or {})
            if error_files:
                extra["TORCHELASTIC_ERROR_FILE"] = str(out / f"error{r}.json")
            env_r = rank_env(r, world, port, **extra)
            job.procs.append(_start(cmd, env_r, out, f"rank{r}", merge, cwd, fresh))
    except BaseException:
        job.kill()
        raise
    return job


def launch_torchrun(
    args: Sequence[str | os.PathLike],
    nproc: int = 2,
    *,
    out: Path,
    env: dict[str, str] | None = None,
    cwd: Path = ROOT,
) -> Job:
    """``python -m torch.distributed.run --standalone --nproc-per-node N ARGS`` as a
    job of one process (torchrun itself: its "rank 0" result holds torchrun's exit code
    and output, stdout and stderr apart); its ranks die with it at the deadline."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(nproc), *map(str, args)]
    # torchrun itself always starts fresh: the tests of it are about the real launcher.
    env_t = base_env(**(env or {}))
    return Job([_start(cmd, env_t, out, "rank0", False, cwd, fresh=True)], out, False)


def torchrun(
    args: Sequence[str | os.PathLike], nproc: int = 2, *, out: Path, timeout_s: float = 120.0, **kw
) -> RankResult:
    """``launch_torchrun`` then wait: torchrun's exit code and output."""
    with launch_torchrun(args, nproc, out=out, **kw) as job:
        return job.wait(timeout_s)[0]


def run_ranks(
    argv: Sequence[str | os.PathLike] | Callable[[int], Sequence[str | os.PathLike]],
    world: int = 2,
    *,
    out: Path,
    timeout_s: float = 120.0,
    **kw,
) -> list[RankResult]:
    """``launch`` then ``wait``: every rank's result, in rank order."""
    with launch(argv, world, out=out, **kw) as job:
        return job.wait(timeout_s)


def wait_all(jobs: dict[str, Job], timeout_s: float, *, fail: bool = True) -> None:
    """Wait for several jobs running side by side, noting when each rank ended; past
    ``patience(timeout_s)`` kill what still runs and (with ``fail``) fail the test. The
    patience is read again at each poll and only grows: a machine that gets busy during
    the wait stretches it too."""
    start, limit = time.monotonic(), patience(timeout_s)
    while not all([job.poll() for job in jobs.values()]):
        limit = max(limit, patience(timeout_s))
        if time.monotonic() - start >= limit:
            break
        time.sleep(0.05)
    late = {name: job.kill() for name, job in jobs.items()}
    late = {name: ranks for name, ranks in late.items() if ranks}
    if late and fail:
        tails = {
            f"{name} rank {r}": res.text[-1500:]
            for name, ranks in late.items()
            for r, res in enumerate(jobs[name].results())
            if r in ranks
        }
        waited = f"{limit:.0f} s ({timeout_s:.0f} s, stretched by patience())"
        _fail(f"still running after {waited} (killed): {late}\n{tails}")


#: Imported once into the fork server that ``spawn``'s ranks are forked from: what every
#: rank would import first anyway (torch, and torch._dynamo, which torch imports at a
#: process's first optimizer). Together about 2.4 s of CPU per process on CI's cores,
#: most of a small rank's cost: paid once per pytest worker instead of once per rank.
SPAWN_PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel")


def _spawned_rank(rank: int, fn, env: dict, cwd: str, path: list, logs: str, *args) -> None:
    """A rank forked from the fork server, made what a spawned one would be: this
    test's environment, working directory and ``sys.path`` (the server kept those of its
    start), its output in ``logs`` (the server's stdout is no test's), then
    ``fn(rank, *args)``."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    fd = os.open(os.path.join(logs, f"rank{rank}.out"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    for std in (1, 2):
        os.dup2(fd, std)
    os.close(fd)
    fn(rank, *args)


def spawn(fn, args: tuple, nprocs: int = 2, deadline_s: float = 120.0) -> None:
    """``fn(rank, *args)`` in ``nprocs`` fresh processes (torch.multiprocessing), with a
    deadline (``patience(deadline_s)``, read again each second, only growing): a hang
    fails the test instead of blocking the suite, and an exception in a rank fails it
    with that rank's traceback. Each rank is forked from a fork server that has imported
    torch once (``SPAWN_PRELOAD``), with this process's environment, working directory
    and ``sys.path`` at the call, as a spawned process gets them; what the ranks print
    is printed here afterwards (on stderr, so pytest shows it with a failure)."""
    import tempfile

    import torch.multiprocessing as mp

    mp.get_context("forkserver").set_forkserver_preload(list(SPAWN_PRELOAD))
    with tempfile.TemporaryDirectory(prefix="spawn-") as logs:
        env, cwd, path = dict(os.environ), os.getcwd(), list(sys.path)
        ctx = mp.start_processes(
            _spawned_rank,
            args=(fn, env, cwd, path, logs, *args),
            nprocs=nprocs,
            join=False,
            start_method="forkserver",
        )
        try:
            start, limit = time.monotonic(), patience(deadline_s)
            while not ctx.join(timeout=1.0):
                limit = max(limit, patience(deadline_s))
                if time.monotonic() - start > limit:
                    for p in ctx.processes:
                        p.kill()
                    waited = f"{limit:.0f} s ({deadline_s:.0f} s, stretched by patience())"
                    _fail(f"ranks still running after {waited}: a hang")
        finally:
            for r in range(nprocs):
                text = _read(Path(logs, f"rank{r}.out"))
                if text:
                    sys.stderr.write(f"--- spawned rank {r} ---\n{text}")
