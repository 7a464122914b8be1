"""Whether two versions of guardrails record the same thing: fixed-seed CPU runs under
each, compared value for value (metrics.parquet's step, loss, grad_norm, lr, skipped and
tokens; NanGuard's finite history, non-finite steps, spikes and GradScaler skips; the
final weights).

    python benchmarks/version_exact.py BASE_DIR [THIS_DIR]

The runs: NaN batches (skip / warn policies, fused AdamW), a float64 model, gradient
accumulation, ``g.observe()``, a bf16-autocast GradScaler that overflows, 400 steps
with a 7-step metrics ring, a run with loss and grad-norm spikes, metrics or NanGuard
alone; each on NanGuard's CPU path and on the lagged path a GPU takes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _batches(n: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, generator=g)) for _ in range(n)]


def _run(
    out: Path,
    name: str,
    *,
    n=60,
    nan_at=(7, 30, 31),
    lagged=False,
    dtype=None,
    accum=1,
    observe=False,
    scaler=False,
    spikes=(),
    **knobs,
) -> None:
    import torch
    from torch import nn

    import guardrails

    guardrails.NanGuard._lagged_on_cpu = lagged
    dtype = dtype or torch.float32
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)]
    net = nn.Sequential(*layers).to(dtype)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x, y):
            return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    model = Model()
    if scaler:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=knobs.pop("fused", False))
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**100) if scaler else None
    data = _batches(n * accum)
    for s in nan_at:
        data[s - 1][0][1, 2] = math.nan
    for s in spikes:
        data[s - 1] = (data[s - 1][0] * 30, data[s - 1][1] * 30)
    data = [(x.to(dtype), y.to(dtype)) for x, y in data]
    res: dict = {}
    with tempfile.TemporaryDirectory() as d:
        try:
            with guardrails.guard(
                model, opt, data, run_dir=d, progress=False, scaler=sc, **knobs
            ) as g:
                for i, (x, y) in enumerate(g, 1):
                    if scaler:
                        with torch.autocast("cpu", dtype=torch.bfloat16):
                            loss = model(x, y)
                        if i in (3, 8, 9):
                            loss = loss * 2.0**40  # past float32: the scaler skips
                        sc.scale(loss).backward()
                        sc.step(opt)
                        sc.update()
                        opt.zero_grad()
                        continue
                    loss = model(x, y)
                    if observe:
                        g.observe(loss * 1.5)
                    (loss / accum).backward()
                    if i % accum == 0:
                        opt.step()
                        opt.zero_grad()
        except Exception as e:  # a policy's raise is part of what is compared
            res["raised"] = type(e).__name__
        if (Path(d) / "metrics.parquet").exists():
            t = guardrails.read_metrics(d).to_pydict()
            for k in ("step", "loss", "grad_norm", "lr", "skipped", "tokens"):
                res[k] = t[k]
    nan = g.component("nan")
    if nan is not None:
        res["history"] = [list(r) for r in nan.history]
        res["nonfinite"] = list(nan.nonfinite_steps)
        res["spikes"] = [list(s) for s in nan.spikes]
        res["scaler_skips"] = list(nan.scaler_skips)
    res["weights"] = [p.detach().double().flatten().tolist() for p in model.parameters()]
    (out / f"{name}.json").write_text(json.dumps(res))


def child(out: Path) -> None:
    import torch

    torch.set_num_threads(1)
    logging.getLogger("guardrails").setLevel(logging.CRITICAL)
    for lagged in (False, True):
        tag = "lagged" if lagged else "cpu"
        _run(out, f"defaults_{tag}", lagged=lagged)
        _run(out, f"fused_{tag}", lagged=lagged, fused=True)
        _run(out, f"warn_{tag}", lagged=lagged, nan={"policy": "warn"})
        _run(out, f"float64_{tag}", lagged=lagged, dtype=torch.float64)
        _run(out, f"accum_{tag}", lagged=lagged, accum=2, nan_at=(13,))
        _run(out, f"observe_{tag}", lagged=lagged, nan_at=())
        _run(out, f"scaler_{tag}", lagged=lagged, scaler=True, n=16, nan_at=())
        _run(out, f"long_{tag}", lagged=lagged, n=400, nan_at=(150,), metrics={"every_n_steps": 7})
        _run(out, f"spiky_{tag}", lagged=lagged, n=300, nan_at=(250,), spikes=(60, 61, 120, 200))
    _run(out, "metrics_only", nan=False)
    _run(out, "nan_only", metrics=False)


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_same, a, b))
    return a == b


def main() -> None:
    if sys.argv[1] == "--child":
        child(Path(sys.argv[2]))
        return
    base = Path(sys.argv[1])
    this = Path(sys.argv[2]) if len(sys.argv) > 2 else HERE.parent
    with tempfile.TemporaryDirectory() as d:
        outs = {}
        for label, path in (("base", base), ("this", this)):
            out = outs[label] = Path(d) / label
            out.mkdir()
            env = dict(os.environ, PYTHONPATH=str(path))
            subprocess.run([sys.executable, __file__, "--child", str(out)], env=env, check=True)
        same = 0
        for f in sorted(outs["base"].glob("*.json")):
            a = json.loads(f.read_text())
            b = json.loads((outs["this"] / f.name).read_text())
            differ = sorted(k for k in a.keys() | b.keys() if not _same(a.get(k), b.get(k)))
            same += not differ
            print(
                f"  {f.stem:16s} {len(a.get('step', [])):3d} rows, "
                f"{len(a.get('nonfinite') or [])} non-finite, {len(a.get('spikes') or [])} spikes, "
                f"{len(a.get('scaler_skips') or [])} scaler skips: "
                + ("identical" if not differ else f"DIFFER in {', '.join(differ)}")
            )
        print(f"{same} of {len(list(outs['base'].glob('*.json')))} runs identical")


if __name__ == "__main__":
    main()
