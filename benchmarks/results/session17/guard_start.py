"""Seconds of a guard's start on a one-layer model: `import torch, guardrails`; the
model, optimizer and data then `guard()`; `Guard.__enter__`; close (perf_counter)."""

import time

t0 = time.perf_counter()
import tempfile  # noqa: E402

import torch  # noqa: E402

import guardrails  # noqa: E402

t1 = time.perf_counter()
m = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
data = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(5)]
g = guardrails.guard(m, opt, data, run_dir=tempfile.mkdtemp(), progress=False)
t2 = time.perf_counter()
g.__enter__()
t3 = time.perf_counter()
g.__exit__(None, None, None)
t4 = time.perf_counter()
print(f"import {t1 - t0:.2f} guard() {t2 - t1:.2f} enter {t3 - t2:.2f} exit {t4 - t3:.2f}")
