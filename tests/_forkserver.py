"""A fork server for the tests' script-launched processes: ``python SCRIPT ARGS`` without
paying for ``import torch`` each time.

Most of the suite's CPU went into the processes the tests start importing torch (about
3.6 CPU-s each for torch, torch._dynamo and guardrails, ~1,000 of the suite's ~1,250
CPU-s). This server imports torch once (``PRELOAD``) and then, for each request, forks a
child that becomes what ``subprocess.Popen([sys.executable, SCRIPT, *ARGS],
start_new_session=True, stdin=DEVNULL, stdout=..., stderr=...)`` would start (or
of ``[sys.executable, "-c", CODE, *ARGS]``, ``[sys.executable, "-m", MODULE, *ARGS]``):

- its own pid and its own session and process group (signals, ``killpg`` and SIGKILL
  reach it and only it, as before);
- the request's environment, working directory, ``sys.argv`` and ``sys.path`` (the
  script's folder first); a fresh ``__main__`` module running the script;
- the caller's umask, resource limits, CPUs and nice value (read at the request);
- stdin on /dev/null, stdout and stderr on the caller's files (passed as descriptors);
- the signal dispositions and mask the server had before it imported anything, the
  faulthandler as ``PYTHONFAULTHANDLER`` says, NumPy's global generator reseeded (as
  ``random``'s is by Python itself): a fresh process's;
- its real exit status, death by a signal included, reported to the caller.

Only the interpreter's start-up is shared. The server runs no torch operation (its
intra-op pool never starts) and no thread: it refuses to fork with more than one thread
alive. It never runs test code, so nothing a test does can leak into the next test's
processes. Run as ``python tests/_forkserver.py SOCKET``; it exits when its stdin (a
pipe from the pytest process that started it) closes. The client side is
``tests/_ranks.py`` (``ForkServer``).

Protocol, one connection per child: the client sends a 4-byte length and a JSON request
(``argv``, ``env``, ``cwd``) with two descriptors (stdout, stderr); the server answers
``pid N`` when the child runs, then ``status S CPU`` (the raw wait status, the CPU-s it
and the children it reaped used) when it ends, or
``error MESSAGE`` if it could not fork.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import faulthandler
import gc
import importlib
import importlib.machinery
import io
import json
import os
import resource
import runpy
import select
import signal
import socket
import struct
import sys
import threading
import types
from typing import NoReturn

#: Imported once, before any fork: what nearly every worker imports first anyway
#: (torch imports torch._dynamo at a process's first optimizer step), about 3.3 CPU-s
#: of a worker's 3.6 on CI's cores. Not guardrails: it imports pyarrow, whose jemalloc
#: starts a background thread at import, and a fork must find one thread alive; the
#: children import guardrails themselves (about 0.3 CPU-s).
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "torch.utils.data")


#: A process's state before the preload: what each child is given back. The module
#: search path without its first entry (this file's folder) and without the server's
#: PYTHONPATH: each child's own goes in front of it.
def _pythonpath(value: str | None) -> list[str]:
    """The ``sys.path`` entries Python makes of ``PYTHONPATH``: absolute (an empty
    one is the working directory)."""
    return [os.path.abspath(entry) for entry in value.split(os.pathsep)] if value else []


_BASE_PATH = [p for p in sys.path[1:] if p not in _pythonpath(os.environ.get("PYTHONPATH"))]


def _search_path(first: str) -> list[str]:
    """``sys.path`` as Python builds it: PYTHONPATH's entries and the installation's,
    duplicates dropped (``site``), then the script's folder (or '' for ``-c``) in
    front."""
    rest = _pythonpath(os.environ.get("PYTHONPATH")) + _BASE_PATH
    return [first, *dict.fromkeys(rest)]


_START_SIGNALS = {
    sig: signal.getsignal(sig)
    for sig in signal.valid_signals()
    if sig not in (signal.SIGKILL, signal.SIGSTOP)
}


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 2)
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        more = conn.recv(1 << 16)
        if not more:
            raise EOFError("the client closed the connection mid-request")
        data += more
    (size,) = struct.unpack("!I", data[:4])
    return json.loads(data[4 : 4 + size]), fds


def serve(listen: socket.socket) -> tuple[dict, list[int]]:
    """Fork a child per request until stdin closes (then exit). Returns only in a
    child: its request and descriptors."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below
    children: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([listen, wake_r, 0], [], [])
        if 0 in ready and not os.read(0, 4096):
            _end(children)
        if wake_r in ready:
            while True:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    break
        _reap(children)
        if listen not in ready:
            continue
        conn, _ = listen.accept()
        try:
            request, fds = _read_request(conn)
        except (OSError, EOFError, ValueError):
            conn.close()
            continue
        if _threads() != 1:  # a fork now would copy a thread's locks mid-use
            conn.sendall(f"error {_threads()} threads alive in the fork server\n".encode())
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            for fd in (wake_r, wake_w):
                os.close(fd)
            for other in (listen, conn, *children.values()):
                other.close()
            return request, fds
        for fd in fds:
            os.close(fd)
        conn.sendall(f"pid {pid}\n".encode())
        children[pid] = conn


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            cpu_s = usage.ru_utime + usage.ru_stime  # with the children it reaped
            with contextlib.suppress(OSError):  # the caller went away: nobody to tell
                conn.sendall(f"status {status} {cpu_s:.3f}\n".encode())
            conn.close()


def _end(children: dict[int, socket.socket]) -> None:
    """The pytest process is gone: kill what still runs (its whole group), then exit."""
    for pid in children:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    sys.exit(0)


def _become(request: dict, fds: list[int]) -> None:
    """In the child: become ``python SCRIPT ARGS`` as a fresh process would be."""
    os.setsid()
    # Python 3.11 keeps the server's thread id as the main thread's native_id after a
    # fork (the watchdog reads /proc/self/task/<native_id> for its CPU share).
    threading.main_thread()._set_native_id()  # type: ignore[attr-defined]
    for sig, handler in _START_SIGNALS.items():
        if handler is not None and signal.getsignal(sig) != handler:
            signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())

    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    out, err = fds
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in set(fds):
        os.close(fd)

    os.umask(request["umask"])
    for name, limits in request["rlimits"].items():
        if resource.getrlimit(getattr(resource, name)) != tuple(limits):
            resource.setrlimit(getattr(resource, name), tuple(limits))
    os.sched_setaffinity(0, request["cpus"])
    os.setpriority(os.PRIO_PROCESS, 0, request["nice"])

    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = sys.__stdout__ = _text_out(1, unbuffered=unbuffered, line=False)
    sys.stderr = sys.__stderr__ = _text_out(2, unbuffered=unbuffered, line=True)

    faulthandler.disable()
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    if "numpy" in sys.modules:  # a fresh process seeds NumPy's global generator anew
        sys.modules["numpy"].random.seed()


def _text_out(fd: int, *, unbuffered: bool, line: bool) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    stream = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(
        stream,  # type: ignore[arg-type]
        encoding="utf-8",
        errors="backslashreplace" if fd == 2 else "strict",
        line_buffering=line,
        write_through=unbuffered,
    )


def _run_script(argv: list[str]) -> NoReturn:
    """``python SCRIPT ARGS`` (or ``python -c CODE ARGS``, ``python -m MODULE ARGS``):
    the code as a new ``__main__``, an uncaught exception reported as Python reports it
    (without this file's frames), then Python's exit."""
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    module = None
    if argv[1] == "-m":  # as Python's -m: the directory first, runpy runs the module
        module, source, filename = argv[2], "", "<run_module>"
        sys.argv = ["-m", *argv[3:]]
        sys.path[:] = _search_path(os.getcwd())
    elif argv[1] == "-c":
        source, filename = argv[2], "<string>"
        sys.argv = ["-c", *argv[3:]]
        sys.path[:] = _search_path("")
        main.__loader__ = importlib.machinery.BuiltinImporter
    else:
        with io.open_code(argv[1]) as f:
            source, filename = f.read(), argv[1]
        sys.argv = argv[1:]
        sys.path[:] = _search_path(os.path.dirname(os.path.realpath(filename)))
        main.__file__ = filename
        main.__cached__ = None
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", filename)
    sys.modules["__main__"] = main
    try:
        if module is not None:
            runpy._run_module_as_main(module, alter_argv=True)  # type: ignore[attr-defined]
        else:
            exec(compile(source, filename, "exec", dont_inherit=True), main.__dict__)
    except SystemExit as stop:
        _exit(_exit_code(stop))
    except BaseException as exc:  # Python's own top level
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        # As Python's top level does: sys.last_* first (an atexit hook may read them),
        # then the hook.
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc.with_traceback(tb), tb
        sys.excepthook(type(exc), exc, tb)
        _exit(1, by_signal=signal.SIGINT if isinstance(exc, KeyboardInterrupt) else None)
    _exit(0)


def _exit_code(stop: SystemExit) -> int:
    """The status ``sys.exit(code)`` gives: None is 0, a number is itself, anything
    else is printed on stderr and gives 1."""
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code
    print(stop.code, file=sys.stderr)
    return 1


def _exit(code: int, *, by_signal: int | None = None) -> NoReturn:
    """Python's own exit up to its module teardown: non-daemon threads joined, atexit
    functions run, files still open flushed, then the process ends with ``code`` (or
    dies of ``by_signal``, as Python does after an uncaught KeyboardInterrupt). The
    teardown is left out: in a forked child it walked the preload's frozen objects, at
    about 0.7 CPU-s a child, to free memory the kernel frees anyway; and triton's
    bindings report their frozen objects as leaked then."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for obj in gc.get_objects():  # what the teardown would flush: files left open
        if isinstance(obj, (io.BufferedIOBase, io.TextIOBase)):
            with contextlib.suppress(Exception):
                if not obj.closed:
                    obj.flush()
    if by_signal is not None:
        signal.signal(by_signal, signal.SIG_DFL)
        os.kill(os.getpid(), by_signal)
    os._exit(code & 0xFF)


def main() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    # The preload's million objects out of the collector's reach: without this each
    # child's garbage collections (three at its exit) walked them all, writing to their
    # pages (copy-on-write), 0.7 CPU-s a child.
    gc.freeze()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listen:
        listen.bind(sys.argv[1])
        listen.listen(64)
        request, fds = serve(listen)
    _become(request, fds)
    _run_script(request["argv"])


if __name__ == "__main__":
    main()
