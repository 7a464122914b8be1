"""guardrails' own traffic per rank, counted at several world sizes: every call it makes
on the job's key-value store (the side store) and every collective on its gloo side
group, with the bytes, per phase of a run (start, steady, hang, close).

    python benchmarks/store_calls.py [--world 2,4,8] [--scenarios steady,hang,epoch]
                                     [--nodes 1] [--steady-s 10] [--out DIR]

Each run is a real job under torchrun (gloo on CPU, one process per rank): a small
DDP model trained with a fixed step time (``--step-ms``), guarded with the defaults.
In every rank, the side store guardrails opens is wrapped by a counter (a Python proxy
around the real ``PrefixStore``: every call still reaches the real TCPStore), and the
collectives on guardrails' side group are counted the same way. Phases, on every rank:

* ``start``: ``guard.__enter__`` through the first step (preflight, side group, resume);
* ``steady``: the steps after it, for ``--steady-s`` seconds (reported per second);
* ``hang`` (scenario ``hang``): from the step where the last rank stops (it sleeps in
  its loop; the others then wait for it in DDP's all-reduce) until each rank's
  ``HangError``: the failure path, with ``hang_timeout_s=--hang-timeout-s``;
* ``close``: ``guard.__exit__`` (the final save, the end records, the side group);
  scenario ``epoch`` ends every rank's loop by running out of a finite loader of the
  same length (the close that checks for uneven data).

``--nodes K`` runs the job as K simulated nodes: K torchrun agents on this host with a
static rendezvous (``--nnodes K --node-rank i``), the store in node 0's agent.

The loop all-reduces its loss every ``--log-every`` steps (1), as scripts do to log it:
the collective the auditor records and compares across ranks.

The stuck rank's counts are written by a thread every 0.5 s, so a rank the watchdog
ends with ``os._exit`` still reports. What this counts is guardrails' calls only:
torch's own rendezvous traffic and DDP's gradient all-reduces are not in it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
#: Store methods that are one round trip to the store server each.
METHODS = (
    "set",
    "get",
    "add",
    "check",
    "multi_get",
    "multi_set",
    "wait",
    "compare_set",
    "delete_key",
    "num_keys",
)


# --------------------------------------------------------------------------- the rank


class Counts:
    """calls / keys / bytes per (phase, what), from any thread; flushed to a file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.phase = "start"
        self.t0 = {"start": time.monotonic()}
        self.table: dict[str, dict[str, list[int]]] = collections.defaultdict(
            lambda: collections.defaultdict(lambda: [0, 0, 0])
        )
        self.lock = threading.Lock()
        self.extra: dict[str, float] = {}

    def add(self, what: str, keys: int, nbytes: int) -> None:
        with self.lock:
            row = self.table[self.phase][what]
            row[0] += 1
            row[1] += keys
            row[2] += nbytes

    def enter(self, phase: str) -> None:
        with self.lock:
            self.phase = phase
            self.t0[phase] = time.monotonic()

    def dump(self) -> None:
        with self.lock:
            data = {
                "phases": {p: dict(t) for p, t in self.table.items()},
                "t0": self.t0,
                "now": time.monotonic(),
                "extra": self.extra,
            }
        # A file per thread: the flusher and the rank's last dump may write at once.
        tmp = self.path.with_suffix(f".{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)


def _size(x) -> int:
    if x is None:
        return 0
    if isinstance(x, str):
        return len(x.encode())
    if isinstance(x, (bytes, bytearray, memoryview)):
        return len(x)
    if isinstance(x, (list, tuple)):
        return sum(_size(v) for v in x)
    return 8


class CountingStore:
    """The real store, with every call counted (one round trip each)."""

    def __init__(self, store, counts: Counts, owner: str) -> None:
        self._store = store
        self._counts = counts
        self._owner = owner  # the side store's name: watchdog, audit, news, agree...

    def __getattr__(self, name):
        real = getattr(self._store, name)
        if name == "clone":  # a connection of its own (store.wait_keys): counted too

            def clone():
                self._counts.add(f"store.{self._owner}.clone", 0, 0)
                return CountingStore(real(), self._counts, self._owner)

            return clone
        if name not in METHODS:
            return real

        def call(*args, **kwargs):
            out = real(*args, **kwargs)
            keys = args[0] if args else kwargs.get("keys", kwargs.get("key"))
            n_keys = len(keys) if isinstance(keys, (list, tuple)) else 1
            sent = _size(args) + _size(list(kwargs.values()))
            got = _size(out) if name in ("get", "multi_get", "compare_set") else 0
            self._counts.add(f"store.{self._owner}.{name}", n_keys, sent + got)
            return out

        return call


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    out = Path(args.out)
    counts = Counts(out / f"rank{rank}.json")

    def flusher() -> None:
        while True:
            time.sleep(0.5)
            counts.dump()

    threading.Thread(target=flusher, daemon=True).start()

    dist.init_process_group("gloo")
    from guardrails.distributed import store as side

    real_side_store, real_open_group = side.side_store, side.open_side_group
    side_groups = []

    def counted_side_store(generation, name):
        s = real_side_store(generation, name)
        return None if s is None else CountingStore(s, counts, name)

    def counted_open_group(*a, **k):
        t = time.monotonic()
        g = real_open_group(*a, **k)
        counts.extra["side_group_s"] = time.monotonic() - t
        side_groups.append(g)
        return g

    side.side_store, side.open_side_group = counted_side_store, counted_open_group

    from torch.distributed import distributed_c10d as c10d

    def counted(fn_name):
        def call(*a, **k):
            # Looked up at each call: the collective auditor replaces c10d's function
            # at guard start (and leaves ``dist.X`` alone once it is not torch's own
            # any more), so the loop's calls must reach c10d's current one to be seen.
            real = getattr(c10d, fn_name)
            group = k.get("group")
            if group is None:
                group = next((x for x in a if isinstance(x, dist.ProcessGroup)), None)
            if group is not None and any(group is g for g in side_groups):
                tensors = [x for x in a if isinstance(x, torch.Tensor)]
                counts.add(f"side.{fn_name}", 1, sum(t.numel() * t.element_size() for t in tensors))
            return real(*a, **k)

        setattr(dist, fn_name, call)

    for fn in (
        "all_reduce",
        "all_gather",
        "all_gather_object",
        "broadcast",
        "broadcast_object_list",
        "barrier",
        "gather_object",
        "scatter_object_list",
    ):
        counted(fn)

    from torch.nn.parallel import DistributedDataParallel as DDP

    import guardrails

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def batches():
        g = torch.Generator().manual_seed(rank)
        # "epoch": a finite loader, the same length on every rank, so the loop ends by
        # running out of data (the close that checks for uneven data).
        n = round(args.steady_s * 1000 / args.step_ms) + 1 if args.scenario == "epoch" else None
        i = 0
        while n is None or i < n:
            i += 1
            yield torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)

    step_s = args.step_ms / 1000
    steady_steps = round(args.steady_s / step_s)
    hang_step = None
    error = None
    try:
        with guardrails.guard(
            model,
            opt,
            batches(),
            run_dir=out / "run",
            progress=False,
            resume=None,
            watchdog={"hang_timeout_s": args.hang_timeout_s},
            # --rewind-every: guard(rewind=...) on, its snapshot cadence (its store
            # calls: one per rank per snapshot step)
            **(
                {"rewind": {"snapshot_every_steps": args.rewind_every}} if args.rewind_every else {}
            ),
        ) as g:
            for x, y in g:
                t = time.monotonic()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                if args.log_every and g.step % args.log_every == 0:
                    # The loop's own collective, as training scripts average the loss
                    # for logging: what the collective auditor records and compares.
                    dist.all_reduce(loss.detach())
                opt.step()
                opt.zero_grad()
                if g.step == 1:
                    counts.enter("steady")
                elif (
                    counts.phase == "steady"
                    and args.scenario != "epoch"  # that one ends when its data does
                    # A step count, the same on every rank: a per-rank time budget
                    # would leave some ranks waiting for others that already left
                    # (which the watchdog reports as a failure, rightly).
                    and g.step >= 1 + steady_steps
                ):
                    if args.scenario == "steady":
                        break
                    counts.enter("hang")
                    hang_step = g.step
                    if rank == world - 1:
                        counts.dump()
                        time.sleep(10**6)  # stuck: the others wait in the next all-reduce
                time.sleep(max(0.0, step_s - (time.monotonic() - t)))
            counts.enter("close")
    except BaseException as e:
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if counts.phase == "hang":
            counts.extra["hang_error_after_s"] = time.monotonic() - counts.t0["hang"]
        raise
    finally:
        counts.extra["hang_step"] = hang_step or -1
        counts.extra["error"] = error or ""
        counts.enter("done")
        counts.dump()


# --------------------------------------------------------------------------- the parent


def run(world: int, scenario: str, args: argparse.Namespace, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    nodes = args.nodes
    if world % nodes:
        raise SystemExit(f"--world {world} is not a multiple of --nodes {nodes}")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--monitor-interval=0.5"]
    if nodes == 1:
        launchers = [[*launcher, f"--nproc-per-node={world}"]]
    else:
        # Simulated nodes: one torchrun agent per "node" on this host, static rendezvous
        # through node 0's agent, whose store is the job's (as on a real cluster).
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        launchers = [
            [
                *launcher,
                f"--nnodes={nodes}",
                f"--node-rank={i}",
                f"--nproc-per-node={world // nodes}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
            ]
            for i in range(nodes)
        ]
    child = [
        str(HERE),
        "--child",
        "--scenario",
        scenario,
        "--out",
        str(out),
        "--steady-s",
        str(args.steady_s),
        "--step-ms",
        str(args.step_ms),
        "--hang-timeout-s",
        str(args.hang_timeout_s),
        "--rewind-every",
        str(args.rewind_every),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    t = time.monotonic()
    procs = [
        subprocess.Popen(
            [*cmd, *child], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for cmd in launchers
    ]
    logs, rcs = [], []
    for proc in procs:
        try:
            logs.append(
                proc.communicate(timeout=max(1.0, args.timeout_s - (time.monotonic() - t)))[0]
            )
        except subprocess.TimeoutExpired:
            proc.kill()
            logs.append(proc.communicate()[0])
        rcs.append(proc.returncode)
    wall = time.monotonic() - t
    (out / "torchrun.log").write_text("\n".join(logs))
    ranks = {}
    for r in range(world):
        p = out / f"rank{r}.json"
        if p.exists():
            ranks[r] = json.loads(p.read_text())
    return {
        "world": world,
        "scenario": scenario,
        "rc": max(rcs, key=abs),
        "nodes": nodes,
        "wall_s": wall,
        "ranks": ranks,
    }


def summarize(res: dict) -> list[str]:
    """One line per phase: per-rank calls (round trips) and bytes, mean and max over
    ranks; the steady phase per second."""
    lines = []
    phases = collections.OrderedDict()
    for r, data in res["ranks"].items():
        t0 = data["t0"]
        order = sorted(t0, key=t0.get)
        ends = {
            p: (t0[order[i + 1]] if i + 1 < len(order) else data["now"])
            for i, p in enumerate(order)
        }
        for p, table in data["phases"].items():
            calls = sum(v[0] for k, v in table.items() if k.startswith("store."))
            keys = sum(v[1] for k, v in table.items() if k.startswith("store."))
            nbytes = sum(v[2] for k, v in table.items() if k.startswith("store."))
            coll = sum(v[0] for k, v in table.items() if k.startswith("side."))
            secs = max(1e-9, ends[p] - t0[p])
            if p == "steady":
                calls, keys, nbytes, coll = (x / secs for x in (calls, keys, nbytes, coll))
            phases.setdefault(p, []).append((int(r), calls, keys, nbytes, coll, secs, table))
    for p, rows in phases.items():
        per_s = " /s" if p == "steady" else ""
        mean = [sum(x[i] for x in rows) / len(rows) for i in (1, 2, 3, 4)]
        mx = [max(x[i] for x in rows) for i in (1, 2, 3, 4)]
        lines.append(
            f"  {p:7s} ranks={len(rows):3d}  store calls{per_s} mean {mean[0]:8.1f}"
            f" max {mx[0]:8.1f}"
            f"  keys mean {mean[1]:8.1f}  bytes{per_s} mean {mean[2]:10.0f} max {mx[2]:10.0f}"
            f"  side collectives{per_s} mean {mean[3]:6.2f}"
            + (
                f"  lasted {min(x[5] for x in rows):.1f}-{max(x[5] for x in rows):.1f} s"
                if p in ("hang", "close")
                else ""
            )
        )
        methods = collections.Counter()
        for row in rows:
            for k, v in row[6].items():
                methods[k] += v[0]
        if p == "steady":  # per rank per second
            rank_s = sum(x[5] for x in rows)
            lines.append(
                "          by call, per rank per second: "
                + ", ".join(
                    f"{k.split('.', 1)[1]} {v / rank_s:.2f}" for k, v in methods.most_common()
                )
            )
        else:
            lines.append(
                "          by call, per rank: "
                + ", ".join(
                    f"{k.split('.', 1)[1]} {v / len(rows):.1f}" for k, v in methods.most_common()
                )
            )
    log = (Path(res["out"]) / "torchrun.log").read_text() if "out" in res else ""
    errs = collections.Counter(d["extra"].get("error", "")[:60] for d in res["ranks"].values())
    errs.update({"ranks failed with HangError": log.count("failed with HangError")} if log else {})
    hang_s = [
        d["extra"]["hang_error_after_s"]
        for d in res["ranks"].values()
        if "hang_error_after_s" in d["extra"]
    ]
    side_s = [d["extra"].get("side_group_s", 0) for d in res["ranks"].values()]
    lines.append(
        f"  side group creation max {max(side_s or [0]):.3f} s; errors {dict(errs)}"
        + (f"; HangError after {min(hang_s):.1f}-{max(hang_s):.1f} s" if hang_s else "")
    )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", default="2,4,8")
    p.add_argument("--scenarios", default="steady,hang")
    p.add_argument("--scenario", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--steady-s", type=float, default=10.0)
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--hang-timeout-s", type=float, default=10.0)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--log-every", type=int, default=1, help="the loop's all_reduce (0: none)")
    p.add_argument("--nodes", type=int, default=1, help="simulated nodes (torchrun agents)")
    p.add_argument("--rewind-every", type=int, default=0, help="guard(rewind=...): snapshot steps")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.child:
        rank_main(args)
        return
    base = Path(args.out or tempfile.mkdtemp(prefix="guardrails-store-calls-"))
    results = []
    print(
        f"# guardrails' store calls per rank (torch {__import__('torch').__version__}, "
        f"{os.cpu_count()} cores, step {args.step_ms:.0f} ms, steady {args.steady_s:.0f} s, "
        f"hang_timeout_s {args.hang_timeout_s:.0f})",
        flush=True,
    )
    for scenario in args.scenarios.split(","):
        for world in (int(w) for w in args.world.split(",")):
            res = run(world, scenario, args, base / f"{scenario}-{world}x{args.nodes}")
            results.append(res)
            print(
                f"{scenario} N={world} nodes={args.nodes}: rc {res['rc']}, {res['wall_s']:.0f} s",
                flush=True,
            )
            for line in summarize(res):
                print(line, flush=True)
    (base / "results.json").write_text(json.dumps(results, default=str))
    print(f"raw: {base}")


if __name__ == "__main__":
    main()
