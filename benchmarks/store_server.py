"""What one TCPStore server sustains: calls per second with guardrails' steady call mix,
from several client processes, so the per-rank counts of ``store_calls.py`` can be
projected to a job's size.

    python benchmarks/store_server.py [--clients 1,2,4] [--seconds 5]

A ``TCPStore`` server (the kind torchrun's agent or ``init_process_group`` runs) in
this process, and ``--clients`` processes, each calling it as fast as it can through a
``PrefixStore`` with the mix a rank's watchdog and auditor make in steady state
(``store_calls.py``, 2026-11-28: per second ~5 ``check`` of one key, 1 ``set`` of a
~300-byte record, 1 ``add``). Reported: the total calls per second and the mean round
trip. On a 2-core machine the clients compete with the server for the cores, so this is
a lower bound of what a dedicated store host sustains.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import socket
import time

MIX = ("check",) * 5 + ("set", "add")
RECORD = "x" * 300


def _client(port: int, seconds: float, rank: int, out) -> None:
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30)
    )
    prefix = dist.PrefixStore(f"guardrails/g0/watchdog/{rank}/", store)
    prefix.set("hb", RECORD)
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for op in MIX:
            if op == "check":
                prefix.check(["verdict"])
            elif op == "set":
                prefix.set("hb", RECORD)
            else:
                prefix.add("ends", 0)
        n += len(MIX)
    out.put(n)


def main() -> None:
    import torch
    import torch.distributed as dist

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,2,4")
    p.add_argument("--seconds", type=float, default=5.0)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    print(
        f"# one TCPStore server, guardrails' steady mix (5 check, 1 set of 300 B, 1 add); "
        f"torch {torch.__version__}, {os.cpu_count()} cores, {args.seconds:.0f} s a run"
    )
    ctx = mp.get_context("spawn")
    for k in (int(c) for c in args.clients.split(",")):
        out = ctx.Queue()
        procs = [ctx.Process(target=_client, args=(port, args.seconds, i, out)) for i in range(k)]
        for proc in procs:
            proc.start()
        calls = sum(out.get(timeout=120) for _ in procs)
        for proc in procs:
            proc.join()
        rate = calls / args.seconds
        print(
            f"clients {k}: {rate:9.0f} calls/s in all, "
            f"{1e6 * args.seconds * k / calls:7.1f} us a round trip per client"
        )
    del server


if __name__ == "__main__":
    main()
