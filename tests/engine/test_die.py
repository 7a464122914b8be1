"""How a process guardrails ends from a thread (``Guard.die``) says its last words: a
real process, a real SIGTERM to a rank whose main thread is stuck, real files."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from _ranks import base_env, patience

# One gloo rank; its main thread sleeps inside step 3, so the SIGTERM's stop cannot
# reach a boundary and the signal watcher ends the process through Guard.die. The last
# component (before the checkpointer, so its on_abort runs after the checkpointer's)
# records whether the process group was still up when its last word began, then never
# returns: a last word that waits for a GPU whose queue sits behind the stuck collective.
SCRIPT = r"""
import json, os, sys, time
import torch
import torch.distributed as dist
import guardrails

out = sys.argv[1]
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")


class StuckWord(guardrails.Component):
    name = "stuck_word"
    before = ("checkpoint",)

    def on_abort(self, guard, error):
        with open(out + ".words", "w") as f:
            json.dump({"process_group_up": dist.is_initialized()}, f)
        time.sleep(3600)


torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(20)]
checkpointer = guardrails.SignalCheckpointer(failure_save_timeout_s=10)
with guardrails.Guard(
    model, opt, data, run_dir=out, components=[StuckWord(), checkpointer]
) as g:
    for x, y in g:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if g.step == 3:
            open(out + ".stuck", "w").close()
            time.sleep(3600)
"""


def test_the_process_group_is_aborted_before_the_last_words_and_a_stuck_one_is_bounded(
    tmp_path,
):
    """Guard.die aborts the process groups after the failure save and before the other
    components' last words, so a last word that would wait for a GPU wedged behind the
    stuck collective finds it freed (2 H200: a rank was held 14 s past its save, until
    the bound); and a last word that never returns is given up after its bound: the
    process still ends with the stop's exit code and its report."""
    out = str(tmp_path / "run")
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, out],
        env=base_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + patience(60)
    while not (tmp_path / "run.stuck").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    text = proc.communicate(timeout=patience(90))[0]
    assert proc.returncode == 128 + signal.SIGTERM, text
    assert "SIGTERM received at step 3" in text and "made no progress" in text, text
    words = json.loads((tmp_path / "run.words").read_text())
    assert words == {"process_group_up": False}, text
    assert "gave up saying its last words after 5 s" in text, text
