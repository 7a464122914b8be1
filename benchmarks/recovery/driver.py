"""Failure-injection benchmark: a real multi-rank job under a schedule of faults, two arms.

    nice -n 10 python benchmarks/recovery/driver.py --minutes 10 --fault-every-s 60 --ranks 4
    nice -n 10 python benchmarks/recovery/driver.py --smoke          # ~3 minutes, 2 faults

Runs ``train.py`` under torchrun (gloo on CPU; ``--nodes 2`` simulated nodes, each its own
torchrun agent on this host, c10d rendezvous on localhost) once per arm (``plain``,
``guardrails``), injects from outside, at fixed wall times, the faults in turn: ``kill9``
(SIGKILL of rank 1), ``hang`` (SIGUSR2: rank N-1 sleeps inside its step), ``nan`` (rank 0's
loss NaN for 10 steps), ``sigterm`` (every rank: a pre-emption), ``node`` (SIGKILL of every
process of the last node's agent, or the first's with ``--lost-node first``: it hosts the
rendezvous store; the copies the node's ranks held in ``/dev/shm`` are removed with
it). The job comes back by ``--restart requeue`` (the same
command again once every agent has exited, as SLURM's requeue) or ``--restart torchrun``
(``--max-restarts``; a lost node's agent is started again; if every agent gives up, the job
is requeued and the report says so). At ``--minutes`` the driver asks the job to stop (a
file the ranks agree on), then re-runs the same steps uninterrupted to check the final
weights bitwise. Writes ``benchmarks/results/recovery-<date>.json`` and a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
import measure  # noqa: E402
import report  # noqa: E402

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
ERROR_LINE = re.compile(r"Traceback|[A-Za-z]+Error\b|exitcode|failed", re.IGNORECASE)
KILL_OTHERS_AFTER_S = 10.0  # requeue: once one agent has ended, the rest get this long
POLL_S = 0.1
MAX_FAILED_LAUNCHES = 3  # a job that never trains after this many launches is given up


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def host_address() -> str:
    """This host's first non-loopback address: each simulated node's agent announces it, so
    that node 1's ranks see a MASTER_ADDR that is not loopback (guardrails' launch check
    refuses a loopback MASTER_ADDR on a node other than the first, as it should on real nodes)."""
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    return out[0] if out else "localhost"


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in their own sessions)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    kids = [int(p) for p in out.split()]
    return kids + [d for k in kids for d in descendants(k)]


class Agent:
    """One torchrun agent (a simulated node), its output timestamped line by line."""

    def __init__(self, cmd: list[str], log_path: Path, error_lines: list[float]) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True,
        )  # fmt: skip
        self.cmd = cmd
        self.exit_t: float | None = None
        self.thread = threading.Thread(target=self._read, args=(log_path, error_lines), daemon=True)
        self.thread.start()

    def _read(self, log_path: Path, error_lines: list[float]) -> None:
        with open(log_path, "a") as f:
            for line in self.proc.stdout:
                t = time.time()
                f.write(f"{t:.3f} {line}")
                if ERROR_LINE.search(line):
                    error_lines.append(t)

    def poll(self) -> int | None:
        rc = self.proc.poll()
        if rc is not None and self.exit_t is None:
            self.exit_t = time.time()
        return rc

    def kill(self) -> None:
        """SIGKILL the agent and every worker under it: a node lost."""
        for pid in descendants(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


class Job:
    """One arm's job: its agents, its restarts, its faults, all on the driver's clock."""

    def __init__(self, a: argparse.Namespace, arm: str, run_dir: Path, steps: int) -> None:
        self.a, self.arm, self.run_dir, self.steps = a, arm, run_dir, steps
        self.agents: list[Agent] = []
        self.exits: list[float] = []  # the job ended (every agent), to be requeued
        self.launches: list[float] = []
        self.error_lines: list[float] = []
        self.notes: list[str] = []
        self.port = 0
        self.failed_launches = 0  # launches in a row that never trained a step
        self.killed = False  # this attempt was ended by the driver, not by its agents

    def agent_cmd(self, node: int) -> list[str]:
        a = self.a
        every_s = a.plain_ckpt_every_s if self.arm == "plain" else a.guard_ckpt_every_s
        return [
            TORCHRUN, f"--nnodes={a.nodes}", f"--node-rank={node}",
            f"--nproc-per-node={a.ranks // a.nodes}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={a.host_addr}:{self.port}", f"--rdzv-id=recobench{self.port}",
            f"--local-addr={a.host_addr}",
            f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}",
            f"--max-restarts={a.max_restarts if a.restart == 'torchrun' else 0}",
            str(HERE / "train.py"), f"--arm={self.arm}", f"--run-dir={self.run_dir}",
            f"--steps={self.steps}", f"--step-s={a.step_s}",
            f"--ckpt-every-s={every_s}",
            f"--hang-timeout-s={a.hang_timeout_s}", f"--final={self.run_dir / 'final.pt'}",
            f"--sync={a.sync}",
        ]  # fmt: skip

    def launch(self) -> None:
        """The same command again (a fresh rendezvous port: the last one may be in TIME_WAIT)."""
        self.port = free_port()
        self.killed = False
        self.launches.append(time.time())
        self.agents = []
        for node in range(self.a.nodes):
            log = self.run_dir / f"agent{node}.log"
            self.agents.append(Agent(self.agent_cmd(node), log, self.error_lines))

    def relaunch_node(self, node: int) -> None:
        self.notes.append(f"{time.time():.1f}: agent {node} started again")
        log = self.run_dir / f"agent{node}.log"
        self.agents[node] = Agent(self.agent_cmd(node), log, self.error_lines)

    def kill_all(self) -> None:
        self.killed = True
        for agent in self.agents:
            agent.kill()

    def rank_pid(self, rank: int) -> int | None:
        """The live pid of ``rank``, from its own pid file."""
        try:
            pid = int((self.run_dir / "pids" / f"rank{rank}.pid").read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return None
        return pid if b"train.py" in cmdline else None

    def inject(self, kind: str) -> None:
        a = self.a
        if kind == "kill9":
            self._signal(1, signal.SIGKILL)
        elif kind == "hang":
            self._signal(a.ranks - 1, signal.SIGUSR2)
        elif kind == "nan":
            (self.run_dir / "nan").touch()
        elif kind == "sigterm":
            for rank in range(a.ranks):
                self._signal(rank, signal.SIGTERM)
        elif kind == "node":
            agent = self.agents[0 if a.lost_node == "first" else -1]
            # The c10d rendezvous numbers the nodes in the order they joined: the ranks
            # are those whose processes run under this agent.
            under = set(descendants(agent.proc.pid))
            ranks = [r for r in range(a.ranks) if self.rank_pid(r) in under]
            agent.kill()
            self.forget_ranks(ranks)
            self.notes.append(f"{time.time():.1f}: node of ranks {ranks} lost")

    def forget_ranks(self, ranks: list[int]) -> None:
        """A lost node's memory goes with it: the copies its ranks published in
        ``/dev/shm`` and the copies they kept of their partners on the other node (the
        simulated nodes share this host's ``/dev/shm``; a survivor must not read there
        what a real lost node would take with it). Removed at once, before the survivors'
        save, which waits 10 s for a rank that never begins."""
        local = self.a.ranks // self.a.nodes
        kept = [(r - local) % self.a.ranks for r in ranks]
        names = [f"guardrails-peer-*-rank{r}" for r in ranks]
        names += [f"guardrails-peer-*-rank{k}-mirror" for k in kept]
        for name in names:
            for path in Path("/dev/shm").glob(name):
                with contextlib.suppress(OSError):
                    path.unlink()

    def _signal(self, rank: int, sig: int) -> None:
        pid = self.rank_pid(rank)
        if pid is None:
            self.notes.append(f"{time.time():.1f}: rank {rank} not running, {sig!r} not sent")
            return
        os.kill(pid, sig)

    def step_on(self) -> None:
        """Poll the agents: requeue the job when it has ended, restart a lost node's agent."""
        rcs = [agent.poll() for agent in self.agents]
        if all(rc is not None for rc in rcs):
            if all(rc == 0 for rc in rcs) and (self.run_dir / "stop").exists():
                return
            self.exits.append(max(agent.exit_t for agent in self.agents))
            trained = training_since(self.run_dir, self.launches[-1])
            self.failed_launches = 0 if trained else self.failed_launches + 1
            if self.failed_launches >= MAX_FAILED_LAUNCHES:
                return
            if self.a.restart == "torchrun" and not self.killed:
                self.notes.append(f"{time.time():.1f}: every agent gave up: requeued")
            self.launch()
            return
        ended = [ag.exit_t for ag, rc in zip(self.agents, rcs, strict=True) if rc is not None]
        if not ended:
            return
        if self.a.restart == "requeue" and time.time() - min(ended) > KILL_OTHERS_AFTER_S:
            self.notes.append(
                f"{time.time():.1f}: agents still up {KILL_OTHERS_AFTER_S:g} s after one ended: "
                "killed (as srun --kill-on-bad-exit)"
            )
            self.kill_all()
        elif self.a.restart == "torchrun":
            for node, rc in enumerate(rcs):
                if rc is not None and rc < 0:  # killed from outside: the node comes back
                    self.relaunch_node(node)

    def finished(self) -> bool:
        return all(agent.poll() == 0 for agent in self.agents) and (self.run_dir / "stop").exists()


def training_since(run_dir: Path, t: float) -> bool:
    """Whether rank 0 finished a clean step after ``t`` (cheap: the log's tail)."""
    path = run_dir / "log" / "rank0.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - 2000))
            lines = f.read().decode(errors="replace").splitlines()[1:]
    except OSError:
        return False
    for line in reversed(lines):
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if e["t"] <= t:
            return False
        if e["ev"] == "step" and not e.get("nan"):
            return True
    return False


def run_arm(a: argparse.Namespace, arm: str, work: Path) -> dict:
    """One arm under the schedule: faults at their times (held back while the job is still
    recovering from the last one), stop at ``--minutes`` once it trains, then the numbers."""
    run_dir = work / arm
    run_dir.mkdir(parents=True)
    steps = 10 * int(a.minutes * 60 / a.step_s)  # never reached: the stop file ends the run
    job = Job(a, arm, run_dir, steps)
    faults = measure.schedule(minutes=a.minutes, fault_every_s=a.fault_every_s, kinds=a.faults)
    injected: list[tuple[str, float, float]] = []  # kind, scheduled, injected
    start = time.time()
    job.launch()
    try:
        end = drive(a, job, faults, injected, start)
    finally:
        job.kill_all()  # nothing of the job outlives the driver
    return analyse(a, arm, job, injected, start, end)


def drive(a, job: Job, faults, injected, start: float) -> float:
    """The schedule's loop; returns the clock time the job ended."""
    arm, run_dir = job.arm, job.run_dir
    last_fault_t = start
    while True:
        now = time.time()
        job.step_on()
        settled = training_since(run_dir, last_fault_t + a.settle_s)
        if faults and now - start >= faults[0][0] and settled:
            offset, kind = faults.pop(0)
            last_fault_t = time.time()
            job.inject(kind)
            injected.append((kind, offset, last_fault_t - start))
            print(f"[{arm}] {last_fault_t - start:6.1f}s {kind}", flush=True)
        elif not settled and now - last_fault_t > a.stuck_s and last_fault_t > start:
            job.notes.append(f"{now:.1f}: not training {a.stuck_s}s after a fault: killed")
            job.kill_all()
            last_fault_t = now
        if now - start >= a.minutes * 60:
            if faults:
                job.notes.append(f"not injected, the run was over: {faults}")
                faults = []
            if settled:
                (run_dir / "stop").touch()
        if job.finished():
            break
        if job.failed_launches >= MAX_FAILED_LAUNCHES:
            job.notes.append(f"gave up: {MAX_FAILED_LAUNCHES} launches in a row never trained")
            break
        if now - start > a.minutes * 60 * 4 + 600:
            job.notes.append("gave up: the run took over 4x its minutes")
            job.kill_all()
            break
        time.sleep(POLL_S)
    return time.time()


def analyse(a, arm: str, job: Job, injected, start: float, end: float) -> dict:
    events = measure.read_events(job.run_dir / "log")
    fault_ts = [start + t for _, _, t in injected] + [end]
    recoveries = [
        measure.recovery(
            kind, start + t, events, until_t=fault_ts[i + 1], exits=job.exits,
            error_lines=job.error_lines,
        ).row()
        for i, (kind, _, t) in enumerate(injected)
    ]  # fmt: skip
    for r, (_, offset, t) in zip(recoveries, injected, strict=True):
        r["scheduled_s"], r["injected_s"] = offset, t
    done = [e for e in events if e["ev"] == "done" and e["rank"] == 0]
    final_step = done[-1]["step"] if done else None
    return {
        "arm": arm,
        "restart": a.restart,
        "launches": len(job.launches),
        "requeues": len(job.exits),
        "final_step": final_step,
        "recoveries": recoveries,
        "goodput": measure.goodput(events, start_t=start, end_t=end, final_step=final_step),
        "notes": job.notes,
        "run_dir": str(job.run_dir),
    }


def bitwise(a: argparse.Namespace, result: dict, work: Path) -> dict:
    """Re-run the arm's final steps uninterrupted (the plain loop, unpaced) and compare the
    final weights exactly (a step the NaN policy skipped made no change: nothing to redo)."""
    import torch

    if result["final_step"] is None:
        return {"equal": None, "why": "the run did not finish"}
    ref_dir = work / f"reference-{result['arm']}"
    ref_dir.mkdir()
    cmd = [
        TORCHRUN, "--nnodes=1", f"--nproc-per-node={a.ranks}", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{free_port()}", str(HERE / "train.py"), "--arm=plain",
        f"--run-dir={ref_dir}", f"--steps={result['final_step']}", "--step-s=0",
        "--ckpt-every-s=1e9", f"--sync={a.sync}",
        f"--final={ref_dir / 'final.pt'}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    got = torch.load(Path(result["run_dir"]) / "final.pt")
    want = torch.load(ref_dir / "final.pt")
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    return {"equal": not differ, "differing": differ}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", nargs="+", default=["plain", "guardrails"])
    p.add_argument("--minutes", type=float, default=10.0, help="each arm's run, in wall minutes")
    p.add_argument("--fault-every-s", type=float, default=60.0)
    p.add_argument(
        "--faults",
        nargs="+",
        default=list(measure.FAULT_KINDS),
        choices=measure.FAULT_KINDS,
        help="in turn, one every --fault-every-s",
    )
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes: torchrun agents")
    p.add_argument(
        "--lost-node",
        choices=["last", "first"],
        default="last",
        help="which node the node fault takes: the first hosts the rendezvous store",
    )
    p.add_argument("--step-s", type=float, default=0.2, help="each step is paced to this")
    p.add_argument(
        "--plain-ckpt-every-s",
        type=float,
        default=None,
        help="default: a third of the run (the issue's 10 minutes of 30)",
    )
    p.add_argument(
        "--guard-ckpt-every-s",
        type=float,
        default=None,
        help="checkpoint={'every_s': ...}; default: the plain arm's",
    )
    p.add_argument(
        "--hang-timeout-s",
        type=float,
        default=30.0,
        help="the process group's timeout (both arms) and the watchdog's",
    )
    p.add_argument(
        "--sync",
        choices=["allreduce", "ddp"],
        default="allreduce",
        help="train.py's --sync: under DDP guardrails knows every rank holds the same "
        "optimizer state, so a dead rank's part of a failure save is written by a live "
        "one (its published copy); under the per-parameter all-reduce it cannot tell",
    )
    p.add_argument("--restart", choices=["requeue", "torchrun"], default="requeue")
    p.add_argument("--max-restarts", type=int, default=100)
    p.add_argument(
        "--settle-s",
        type=float,
        default=2.0,
        help="a fault waits until the job trained this long after the last one",
    )
    p.add_argument(
        "--stuck-s",
        type=float,
        default=300.0,
        help="not training this long after a fault: the driver kills the job",
    )
    p.add_argument("--host-addr", default=None, help="default: this host's first address")
    p.add_argument("--smoke", action="store_true", help="1.5 minutes an arm, 2 faults")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--work-dir", default=None, help="default: a temporary directory")
    a = p.parse_args(argv)
    if a.smoke:
        a.minutes, a.fault_every_s, a.faults = 1.5, 30.0, ["kill9", "sigterm"]
    a.host_addr = a.host_addr or host_address()
    if a.plain_ckpt_every_s is None:
        a.plain_ckpt_every_s = a.minutes * 60 / 3
    if a.guard_ckpt_every_s is None:
        a.guard_ckpt_every_s = a.plain_ckpt_every_s
    if "node" in a.faults and a.nodes < 2:
        p.error("the node fault needs --nodes 2 or more")
    return a


def main() -> None:
    a = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally kills the job
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="recobench-"))
    import torch

    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "host_cpus": os.cpu_count(),
        "settings": {k: v for k, v in vars(a).items() if k not in ("out", "work_dir")},
        "arms": [],
    }
    for arm in a.arms:
        result = run_arm(a, arm, work)
        try:
            result["bitwise"] = bitwise(a, result, work)
        except subprocess.CalledProcessError as e:  # the reference run (plain torchrun) failed:
            # its own launch ("connectFullMesh failed" on this torch), not the arm's figures
            result["bitwise"] = {"error": f"the reference run failed (exit {e.returncode})"}
        results["arms"].append(result)
        print(report.markdown(results), flush=True)
    day = results["date"][:10]
    tag = ("-smoke" if a.smoke else "") + ("-torchrun" if a.restart == "torchrun" else "")
    out = Path(a.out) / f"recovery-{day}{tag}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    out.with_suffix(".md").write_text(report.markdown(results))
    print(f"wrote {out}.json and .md; work files in {work}")


if __name__ == "__main__":
    main()
