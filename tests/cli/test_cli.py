"""``python -m guardrails doctor`` and ``report``, run as real processes: doctor on this
GPU-less machine and under torchrun (two gloo ranks), report on runs of the example (an
injected NaN), on a run killed with SIGKILL mid-way and on a directory holding two runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _ranks import ForkServer, patience, run_script
from conftest import events_path, read_events

import guardrails

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_gpt.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cli(*args, env=None, ok=True, timeout=120, cwd=None):
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for name in ("NCCL_DEBUG", "NCCL_P2P_DISABLE", "MASTER_PORT", "WORLD_SIZE", "RANK"):
        if name not in (env or {}):
            full.pop(name, None)  # the developer's shell must not change the assertions
    proc = run_script(
        [sys.executable, "-m", "guardrails", *args], timeout_s=timeout, env=full, cwd=cwd or ROOT
    )
    assert (proc.returncode == 0) == ok, proc.stdout + proc.stderr
    return proc


# ---------------------------------------------------------------------------- doctor


#: A CUDA (or ROCm) build of torch; the doctor tests hold on either, on a machine without
#: a GPU (a CPU build here; a CUDA build on a GPU-less CI runner elsewhere).
CUDA_BUILD = bool(torch.version.cuda or getattr(torch.version, "hip", None))


def test_doctor_on_a_cpu_machine_flags_bad_env():
    if torch.cuda.is_available():
        pytest.skip("about a machine without a GPU; this one has one")
    proc = cli(
        "doctor",
        env={
            "NCCL_P2P_DISABLE": "1",
            "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
            "PYTHONGC_THRESHOLD": "100000",
            "PATH": os.path.dirname(sys.executable) + os.pathsep + "/usr/bin:/bin",
        },
    )
    out = proc.stdout
    assert f"  guardrails {guardrails.__version__}\n" in out
    assert "no GPU found:" in out and "nvidia-smi not found on PATH" in out
    assert re.search(r"^  29500 \(default\): (free|in use)", out, re.M), out
    assert "  NCCL_P2P_DISABLE=1" in out  # shown in the environment section
    if CUDA_BUILD:  # NCCL is there, no GPU is: the setting is judged, torch says why
        cuda = torch.version.cuda or torch.version.hip
        build = f"CUDA {cuda}" if torch.version.cuda else f"ROCm {cuda}"
        assert f"torch {torch.__version__}, {build}, " in out
        assert f"  no GPU visible to torch (a CUDA {cuda} build; torch.cuda.is_available()" in out
        assert "BAD  NCCL_P2P_DISABLE: GPU peer-to-peer (NVLink / PCIe P2P) is off" in out
    else:  # no NCCL, no CUDA: their settings do nothing, and no GPU advice is given
        assert f"torch {torch.__version__}, CUDA none (CPU build)" in out
        assert "  torch is a CPU-only build: it uses no GPU" in out
        assert "note NCCL / CUDA settings: NCCL_P2P_DISABLE is set, but this torch is a " in out
        assert "BAD  NCCL_P2P_DISABLE" not in out and "nvml" not in out.lower()
    assert "NCCL_DEBUG:" not in out  # no "set NCCL_DEBUG=INFO" advice without a GPU
    assert "WARN TORCH_DISTRIBUTED_DEBUG: =DETAIL" in out
    assert "BAD  PYTHONGC_THRESHOLD: is not read by Python" in out
    assert re.search(r"bf16: (native|not native)", out)


def test_doctor_judges_gpu_settings_by_the_torch_build():
    """The three builds a user meets, through doctor's own functions on the readings
    its probes return: this machine runs one build only (the tests above run the real
    probes on it)."""
    from guardrails.cli.doctor import _build_flags, render
    from guardrails.cli.env_rules import env_flags

    env = {"NCCL_P2P_DISABLE": "1", "CUDA_LAUNCH_BLOCKING": "1", "OMP_NUM_THREADS": "1"}
    names = lambda flags: [f["name"] for f in flags]  # noqa: E731
    cpu = env_flags(env, cuda_build=False, gpu_visible=False)
    assert names(cpu) == ["NCCL / CUDA settings"]
    assert cpu[0]["message"].startswith("CUDA_LAUNCH_BLOCKING, NCCL_P2P_DISABLE are set, but")
    no_gpu = env_flags(env, cuda_build=True, gpu_visible=False)
    assert names(no_gpu) == ["NCCL_P2P_DISABLE", "CUDA_LAUNCH_BLOCKING"]  # judged; no advice
    gpu = env_flags({}, cuda_build=True, gpu_visible=True)
    assert names(gpu) == ["NCCL_DEBUG"] and gpu[0]["level"] == "info"  # the advice

    warning = "CUDA initialization: Found no NVIDIA driver on your system."
    versions = {"torch": "2.5.1+cu124", "cuda": "12.4", "cuda_available": False}
    report = {
        "host": "ci",
        "time": "now",
        "python": "3.12",
        "versions": {**versions, "cuda_devices": 0, "cuda_warning": warning},
        "gpus": {"devices": [], "why": "nvidia-smi not found on PATH"},
    }
    out = render(report)
    assert "  torch 2.5.1+cu124, CUDA 12.4, " in out
    assert (
        "  no GPU visible to torch (a CUDA 12.4 build; torch.cuda.is_available() is False): "
        f"this process would train on the CPU; torch says: {warning}" in out
    )
    two = {"devices": [{"index": 0}, {"index": 1}]}
    assert _build_flags({"torch": "2.5.1+cpu", "cuda": None}, two)[0]["message"].startswith(
        "this host has 2 GPU(s) but torch 2.5.1+cpu is a CPU-only build"
    )
    hidden = _build_flags({**versions, "cuda_warning": warning}, two)[0]["message"]
    assert hidden.startswith(f"the driver lists 2 GPU(s) but torch sees none ({warning})")
    assert _build_flags({**versions, "cuda_available": True}, two) == []


def test_doctor_json_is_one_object():
    proc = cli("doctor", "--json", env={"NCCL_IB_TIMEOUT": "1000", "NCCL_DEBUG": "INFO"})
    report = json.loads(proc.stdout)
    assert report["versions"]["torch"] == torch.__version__
    assert report["versions"]["guardrails"] == guardrails.__version__
    assert report["gpus"]["devices"] == [] and report["gpus"]["why"]
    assert report["ports"][0]["port"] == 29500
    flags = {f["name"]: f for f in report["flags"]}
    if CUDA_BUILD:
        assert (
            flags["NCCL_IB_TIMEOUT"]["level"] == "bad"
            and "exponent" in flags["NCCL_IB_TIMEOUT"]["message"]
        )
    else:
        note = flags.pop("NCCL / CUDA settings")
        assert note["level"] == "info"
        assert note["message"].startswith("NCCL_DEBUG, NCCL_IB_TIMEOUT are set, but this torch")
        assert not [name for name in flags if name.startswith(("NCCL", "CUDA"))], flags
    assert "NCCL_DEBUG" not in flags  # set: no advice to set it
    assert report["env"]["NCCL_IB_TIMEOUT"] == "1000"


def test_doctor_names_the_process_holding_the_port():
    # Another process listening, like a rank left over from a previous run.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
            "print(s.getsockname()[1], flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(holder.stdout.readline())
        proc = cli("doctor", env={"MASTER_PORT": str(port)})
    finally:
        holder.kill()
        holder.wait()
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(f"  {port} "))
    assert f"{port} (MASTER_PORT): in use by pid {holder.pid} (" in line, line
    assert f"stop it (`kill {holder.pid}`) or pick another port" in line


@pytest.mark.slow(reason="torchrun and its 2 ranks")
def test_doctor_under_torchrun_compares_ranks(tmp_path):
    # torchrun gives every rank the same environment; a wrapper gives each rank its own
    # data directory, the classic "ranks that see different data directories".
    wrapper = (
        'if [ "$LOCAL_RANK" = 1 ]; then export DATA_DIR=/data/b; else export DATA_DIR=/data/a; '
        f"fi; exec {sys.executable} -m guardrails doctor"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("NCCL_DEBUG", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--no-python",
            "bash",
            "-c",
            wrapper,
        ],
        capture_output=True,
        text=True,
        timeout=patience(120),
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.count("guardrails doctor:") == 1, out  # rank 0 prints for both
    assert "ranks: 2 reported" in out
    assert 'env.DATA_DIR differs: rank 0: "/data/a"; rank 1: "/data/b"' in out
    assert "differences between ranks: 1" in out  # RANK, LOCAL_RANK... are expected to differ
    assert "(MASTER_PORT): in use by pid" in out and "rendezvous store (expected)" in out


# ---------------------------------------------------------------------------- report


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    """The example with a NaN planted in sample row 3 of step 10's batch."""
    tmp = tmp_path_factory.mktemp("nan_run")
    args = ["--steps", "20", "--batch-size", "8", "--sample", "0", "--inject", "bad_sample"]
    proc = run_script(
        [sys.executable, str(EXAMPLE), "--run-dir", str(tmp / "run"), *args],
        timeout_s=300,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
        cwd=tmp,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return tmp / "run"


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000, len(data)  # three panels drawn


#: The report's plot needs matplotlib (the `plot` extra, in `dev`): without it these
#: tests skip instead of failing on the missing PNG.
needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib (the plot extra)"
)


@needs_matplotlib
@pytest.mark.slow(reason="the shared NaN fixture: a run of the example")
def test_report_names_the_skipped_step_and_its_cause(nan_run):
    out = cli("report", str(nan_run)).stdout
    assert "run 1 of 1" in out and "1 rank(s) on cpu" in out
    assert "  steps        20 reached; 20 metric rows" in out
    assert re.search(r"throughput   [\d,]+ tokens/s median", out), out
    assert re.search(r"loss         [\d.]+ \(first 10 steps\) -> [\d.]+ \(last 10\)", out)
    assert "  skipped      1 step(s): 10" in out
    assert "  NaN/Inf      step 10 rank 0: cause bad_data" in out
    assert "argument `weights`, sample row(s) [3]" in out
    assert "batch and diagnosis saved in nonfinite/step00000010-rank0" in out
    assert "recovered    at step 11" in out
    assert "  ended        cleanly at step 20" in out
    assert f"plot         {nan_run / 'report.png'}" in out
    assert_png(nan_run / "report.png")


@needs_matplotlib
@pytest.mark.slow(reason="the shared NaN fixture: a run of the example")
def test_report_json_and_png_path(nan_run, tmp_path):
    png = tmp_path / "plots" / "nan.png"
    facts = json.loads(cli("report", str(nan_run), "--json", "--png", str(png)).stdout)
    assert facts["skipped_steps"] == [10] and facts["last_step"] == 20
    (diag,) = facts["nonfinite"]
    assert diag["cause"] == "bad_data" and "sample row(s) [3]" in diag["message"]
    assert facts["ended"]["clean"] and facts["ended"]["error"] is None
    assert 0 <= facts["data_wait_share"] < 1 and facts["gc_total_s"]["0"] >= 0
    assert facts["png"] == str(png)
    assert_png(png)


CRASH = textwrap.dedent(
    """
    import os, signal, sys, torch
    import guardrails
    sys.path.insert(0, {tests!r})
    from _loops import train_loop_signalled
    from conftest import Regressor, batches, train_loop

    run_dir, write_every = sys.argv[1], float(sys.argv[2])
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # A first run that ends cleanly, then a second one in the same run_dir, killed.
    with guardrails.guard(model, opt, batches(6), run_dir=run_dir, progress=False) as g:
        train_loop(g, model, opt)
    with guardrails.guard(model, opt, batches(40), run_dir=run_dir, progress=False,
                          metrics={{"every_n_steps": 4, "write_every_s": write_every}}) as g:
        # SIGKILL after step 14: no close, no end event.
        train_loop_signalled(g, model, opt, after_step=14, signum=signal.SIGKILL)
    """
)


def crashed_run(tmp_path: Path, write_every_s: float) -> Path:
    script = tmp_path / "crash.py"
    script.write_text(CRASH.format(tests=str(ROOT / "tests")))
    run_dir = tmp_path / "run"
    proc = run_script(
        [sys.executable, str(script), str(run_dir), str(write_every_s)],
        timeout_s=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr  # it really died by SIGKILL
    return run_dir


@needs_matplotlib
@pytest.mark.slow(reason="a training process, SIGKILLed")
def test_report_on_a_run_killed_mid_way(tmp_path):
    run_dir = crashed_run(tmp_path, write_every_s=0)  # a part every 4 steps
    out = cli("report", str(run_dir)).stdout
    assert "run 2 of 2 (the newest; --all for every run)" in out
    # Parts for steps 1-12 were written; the events saw step 14's gc/start only, so
    # the story's last step comes from the metrics.
    assert "  steps        12 reached; 12 metric rows" in out, out
    assert "throughput   unknown" in out  # float batches: no token counts
    assert (
        "  ended        no end event: the process died (SIGKILL / OOM killer / node failure) "
        "after step 12" in out
    )
    assert_png(run_dir / "report.png")

    both = cli("report", str(run_dir), "--all", "--no-png").stdout
    assert "run 1 of 2" in both and "run 2 of 2" in both
    assert "  steps        6 reached; 6 metric rows" in both
    assert "  ended        cleanly at step 6" in both
    assert not (run_dir / "report-run1.png").exists()  # --no-png


def test_report_skips_an_unreadable_metrics_part_and_names_it(tmp_path):
    # Issue 52: one torn part-*.parquet hid every row ("no metric rows were written").
    from conftest import Regressor, batches, train_loop

    run_dir = tmp_path / "run"
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    knobs = {"every_n_steps": 1, "write_every_s": 0}
    with guardrails.guard(
        model, opt, batches(8), run_dir=run_dir, progress=False, checkpoint=False, metrics=knobs
    ) as g:
        train_loop(g, model, opt)
    parts = sorted((run_dir / "metrics.parquet").glob("part-*.parquet"))
    assert len(parts) >= 2, parts
    torn = parts[0]
    rows = len(guardrails.read_metrics(run_dir))
    torn.write_bytes(b"PAR1 not a parquet file PAR1")
    proc = cli("report", str(run_dir), "--json", "--no-png")
    facts = json.loads(proc.stdout)
    assert 0 < facts["metrics_rows"] < rows, facts
    assert proc.stderr.count(f"{torn} cannot be read") == 1, proc.stderr
    assert "the other files' are read" in proc.stderr


@pytest.mark.slow(reason="a training process, SIGKILLed")
def test_report_on_a_run_killed_before_its_first_metrics_part(tmp_path):
    run_dir = crashed_run(tmp_path, write_every_s=3600)
    facts = json.loads(cli("report", str(run_dir), "--json").stdout)
    assert facts["run"] == 2 and facts["metrics_rows"] == 0 and facts["ended"] is None
    assert facts["png"] is None and facts["png_note"] == "no metric rows to plot"
    out = cli("report", str(run_dir), "--no-png").stdout
    assert "no metric rows were written: the run ended before its first part" in out
    assert "no end event: the process died" in out


@pytest.mark.slow(reason="the shared NaN fixture: a run of the example")
def test_report_without_matplotlib_still_tells_the_story(nan_run, tmp_path):
    # A matplotlib that fails to import, first on the path: what a user without the
    # `plot` extra sees.
    fake = tmp_path / "site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    png = tmp_path / "none.png"
    out = cli(
        "report", str(nan_run), "--png", str(png), env={"PYTHONPATH": str(tmp_path / "site")}
    ).stdout
    assert 'matplotlib is missing; pip install "torch-guardrails[plot]"' in out
    assert "  skipped      1 step(s): 10" in out
    assert not png.exists()


def test_report_on_an_empty_dir_and_usage(tmp_path):
    proc = cli("report", str(tmp_path), ok=False)
    assert proc.returncode == 2 and "nothing to report" in proc.stdout
    proc = cli(ok=False)
    assert proc.returncode == 2 and "doctor" in proc.stderr and "report" in proc.stderr


def test_the_guardrails_command_is_the_same_cli():
    """`pip install` puts a `guardrails` console script beside the interpreter; it runs
    the same subcommands as `python -m guardrails` and names itself in its usage."""
    script = Path(sys.executable).parent / "guardrails"
    if not script.exists():
        pytest.skip("the console script is not installed: pip install -e . again")
    proc = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, timeout=patience(120)
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: guardrails ")
    for sub in ("doctor", "report", "inspect", "bench", "run"):
        assert sub in proc.stdout
    assert cli("--help").stdout.startswith("usage: python -m guardrails ")


# ------------------------------------------------------ runs sharing one run_dir

WORLD = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    import guardrails
    from conftest import Regressor, batches, train_loop

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with guardrails.guard(model, opt, batches(6), run_dir=sys.argv[1], progress=False,
                          checkpoint=False) as g:
        train_loop(g, model, opt)
    if dist.is_initialized():
        dist.destroy_process_group()
    """
)


@needs_matplotlib
@pytest.mark.slow(reason="3 training processes: a run of 1 rank, then 2")
def test_report_all_splits_a_one_rank_run_from_the_two_rank_run_after_it(tmp_path):
    """A debugging run on one process, then the real one on two ranks, in one run_dir.
    Rank 1's start came before rank 0's about half the time, and the report put rank 1
    (its events and rows) into the one-rank run: runs are told apart by the id every
    rank of a run logs on its start event, not by start times."""
    from _ranks import run_ranks

    script = tmp_path / "world.py"
    script.write_text(WORLD)
    run_dir = tmp_path / "run"
    for world in (1, 2):
        for r in run_ranks(
            [sys.executable, str(script), str(run_dir)], world, out=tmp_path / f"w{world}"
        ):
            assert r.code == 0, r.out
    starts = [e for e in _events(run_dir) if e["kind"] == "start"]
    assert len({e["run"] for e in starts}) == 2 and len(starts) == 3

    def check(runs):
        one, two = runs
        assert (one["run"], one["ranks"], one["metrics_rows"]) == (1, [0], 6), one
        assert (two["run"], two["ranks"], two["metrics_rows"]) == (2, [0, 1], 12), two
        assert two["steps_per_rank"] == {"0": 6, "1": 6}
        assert two["ended"]["ranks"] == [0, 1] and two["ended"]["missing_ranks"] == []
        assert one["ended"]["ranks"] == [0] and one["ended"]["clean"]

    check(json.loads(cli("report", str(run_dir), "--all", "--json", "--no-png").stdout))
    # Logs written before start events carried the id: the same split, by world size.
    stripped = [{k: v for k, v in e.items() if k != "run"} for e in read_events(run_dir)]
    events_path(run_dir).write_text("".join(json.dumps(e) + "\n" for e in stripped))
    check(json.loads(cli("report", str(run_dir), "--all", "--json", "--no-png").stdout))


def _events(run_dir: Path) -> list[dict]:
    return read_events(run_dir)


# ------------------------------------------------------ pre-emption and resume


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """The example stopped by SIGTERM at step 6 of 12 (exit 143, checkpoint step 6),
    its report then, and the same command again: a second run that resumes at step 6."""
    tmp = tmp_path_factory.mktemp("preempted")
    run_dir = tmp / "run"
    args = [str(EXAMPLE), "--run-dir", str(run_dir), "--steps", "12", "--batch-size", "4"]
    args += ["--sample", "0", "--inject", "sigterm"]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}

    def run():
        return run_script([sys.executable, *args], timeout_s=300, env=env, cwd=tmp)

    first = run()
    assert first.returncode == 143, first.stdout + first.stderr
    before = cli("report", str(run_dir), "--no-png").stdout
    second = run()
    assert second.returncode == 0, second.stdout + second.stderr
    return run_dir, before


@pytest.mark.slow(reason="the shared pre-empted fixture: 2 runs of the example")
def test_a_preemption_is_reported_as_one_not_as_an_error(preempted):
    run_dir, before = preempted
    assert "run 1 of 1" in before
    assert (
        "  ended        stopped by SIGTERM at step 6 (a pre-emption); checkpoint "
        "step_000000006 saved; resume with: the same command (guard(..., resume='auto') "
        "continues from step 6)" in before
    ), before
    assert "with an error" not in before and "SystemExit" not in before
    # Once resumed, the stopped run's story says which run took over.
    runs = json.loads(cli("report", str(run_dir), "--all", "--json", "--no-png").stdout)
    stop = runs[0]["ended"]["preempted"]
    assert stop == {
        "signal": "SIGTERM",
        "step": 6,
        "checkpoint": "checkpoints/step_000000006",
        "resumed_by": 2,
    }
    text = cli("report", str(run_dir), "--all", "--no-png").stdout
    assert (
        "stopped by SIGTERM at step 6 (a pre-emption); checkpoint step_000000006 saved; "
        "resumed by run 2" in text
    ), text


@needs_matplotlib
@pytest.mark.slow(reason="the shared pre-empted fixture: 2 runs of the example")
def test_a_resumed_run_says_where_and_its_plot_starts_at_step_1(preempted, tmp_path):
    run_dir, _ = preempted
    png = tmp_path / "resumed.png"
    facts = json.loads(cli("report", str(run_dir), "--json", "--png", str(png)).stdout)
    assert facts["run"] == 2 and facts["metrics_rows"] == 6  # its own steps 7-12
    assert facts["resumed"] == {
        "step": 6,
        "checkpoint": "checkpoints/step_000000006",
        "from_run": 1,
        "earlier_rows": 6,  # run 1's steps 1-6 start the curve
    }
    assert_png(png)
    out = cli("report", str(run_dir), "--no-png").stdout
    assert (
        "  resumed      at step 6 from checkpoints/step_000000006 (saved by run 1); the plot "
        "starts with run 1's steps up to 6" in out
    ), out
    assert "  ended        cleanly at step 12" in out


# ------------------------------------------------------ start without torch


def _imported(cmd: list[str], env: dict[str, str] | None = None) -> tuple[str, list[str]]:
    """Run ``cmd`` with ``-X importtime`` (PYTHONPROFILEIMPORTTIME): its stdout and
    every module it imported."""
    full = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=patience(120), env=full, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    modules = [
        ln.rsplit("|", 1)[1].strip() for ln in proc.stderr.splitlines() if ln.startswith("import")
    ]
    return proc.stdout, modules


@needs_matplotlib
@pytest.mark.slow(reason="the shared pre-empted fixture: 2 runs of the example")
def test_report_inspect_and_help_never_import_torch(preempted, tmp_path):
    """Importing torch was most of a report's start (3.7-4.0 s median before, 0.5 s after):
    report, inspect and --help import none of it, through ``python -m guardrails`` and
    the console script."""
    run_dir, _ = preempted
    png = tmp_path / "r.png"
    script = Path(sys.executable).parent / "guardrails"
    entries = [[sys.executable, "-m", "guardrails"]]
    if script.exists():  # pip install -e . puts it beside the interpreter
        entries.append([str(script)])
    for entry in entries:
        for args, says, module in (
            (["--help"], "report", "guardrails"),
            (["report", str(run_dir), "--png", str(png)], "resumed      at step 6", "pyarrow"),
            (["report", "--help"], "--all", "guardrails.metrics.file"),
            (["inspect", str(run_dir)], "resume would use: ", "guardrails.util.text"),
        ):
            out, modules = _imported([*entry, *args])
            assert says in out, out
            assert module in modules  # the log is read right (it names no importlib import)
            torch = [m for m in modules if m == "torch" or m.startswith("torch.")]
            assert not torch, f"{' '.join(args)} imported {torch[:3]}"
    assert_png(png)
    # A checkpoint's verification is as strict as resume's: a flipped byte is named.
    ckpt = run_dir / "checkpoints" / "step_000000012"
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    proc = cli("inspect", str(run_dir))  # exit 0: step 6 is still valid
    assert f"why: {weights} is corrupt: its sha256 does not match the manifest" in proc.stdout
    assert "resume would use: " in proc.stdout and proc.stdout.rstrip().endswith("step_000000006")
    data[-1] ^= 1
    weights.write_bytes(bytes(data))


@pytest.mark.slow(reason="the shared NaN fixture: a run of the example")
def test_a_reader_that_leaves_early_gets_no_traceback(nan_run):
    """``guardrails report RUN | head -3``: head exits before the report is written.
    A pipe whose reader is already closed makes every write fail, every time."""
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "guardrails", "report", str(nan_run), "--no-png"],
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            timeout=patience(120),
            cwd=ROOT,
        )
    finally:
        os.close(w)
    assert proc.returncode == 141 and "Traceback" not in proc.stderr, proc.stderr


def test_the_command_table_lists_each_command_with_its_own_help():
    """--help lists the commands from a table, without importing their modules: the
    table's help is each module's own."""
    import importlib

    from guardrails.__main__ import COMMANDS

    for name, (module, help_text) in COMMANDS.items():
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).add_parser(sub)
        (action,) = sub._choices_actions
        assert (action.dest, action.help) == (name, help_text)


# ------------------------------------------------------ the pointer at the end of a run

POINTER = textwrap.dedent(
    """
    import logging, sys, torch
    import guardrails
    from conftest import Regressor, batches

    run_dir, how = sys.argv[1], sys.argv[2]
    if how == "info":
        logging.basicConfig(level=logging.INFO, format="LOG %(name)s: %(message)s")
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with guardrails.guard(model, opt, batches(4), run_dir=run_dir, progress=False) as g:
        # Not train_loop: the loop's own error at step 2.
        for x, y in g:
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            if how == "error" and g.step == 2:
                raise RuntimeError("the loop's own bug")
    """
)


def _on_a_terminal(cmd: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run ``cmd`` with its stderr on a real pseudo-terminal: (exit code, stderr)."""
    import pty

    master, slave = pty.openpty()
    devnull = os.open(os.devnull, os.O_WRONLY)
    # Forked from the fork server (torch imported once) with stderr on the terminal.
    proc = ForkServer.for_env(env).start(cmd, env, ROOT, devnull, slave)
    if proc is None:
        proc = subprocess.Popen(cmd, stdout=devnull, stderr=slave, env=env, cwd=ROOT)
    os.close(slave)
    os.close(devnull)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    code = proc.wait(timeout=patience(120))
    return code, b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


@pytest.mark.slow(reason="3 training processes, 2 on a pseudo-terminal")
def test_a_run_ends_with_one_line_naming_its_report(tmp_path):
    script = tmp_path / "pointer.py"
    script.write_text(POINTER)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    run_dir = tmp_path / "my run"  # a space: the command must still paste
    line = f"guardrails: this run's report: guardrails report '{run_dir}'"

    code, err = _on_a_terminal([sys.executable, str(script), str(run_dir), "plain"], env)
    assert code == 0 and err.count(line) == 1 and err.strip() == line, err
    # Not on a pipe (a test runner, a benchmark loop, a log file): quiet.
    proc = run_script([sys.executable, str(script), str(run_dir), "plain"], timeout_s=120, env=env)
    assert proc.returncode == 0 and "guardrails report" not in proc.stderr, proc.stderr
    # Where the user's logging shows INFO, it is logged there (once, not also printed).
    code, err = _on_a_terminal([sys.executable, str(script), str(run_dir), "info"], env)
    assert code == 0 and err.count("guardrails report") == 1, err
    assert f"LOG guardrails.guard: {line}" in err
    # After an error, the error's own report is what to read: no pointer above it.
    code, err = _on_a_terminal([sys.executable, str(script), str(run_dir), "error"], env)
    assert code == 1 and "RuntimeError: the loop's own bug" in err, err
    assert "guardrails report" not in err
    # And the pointer is right: the newest of the four runs in the directory.
    out = cli("report", str(run_dir), "--no-png").stdout
    assert "run 4 of 4" in out and "ended        with an error at step 2" in out


# ------------------------------------------------------ the story's lines, from written logs


def write_run(
    run_dir: Path,
    events: list[dict],
    steps: range,
    *,
    loss: dict[int, float] | None = None,
    lr: dict[int, float] | None = None,
    step_time_s: float = 0.05,
    skipped: tuple[int, ...] = (),
) -> None:
    """A run_dir as a guard leaves it: ``events`` (``time``, ``rank``, ``level`` and
    ``message`` filled in) and one metrics part of rank 0's ``steps``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from guardrails.metrics.file import METRICS_DIR, conform

    t0 = 1_800_000_000.0
    run_dir.mkdir(parents=True)
    full = [{"time": t0, "rank": 0, "level": "info", "message": "", **e} for e in events]
    for i, e in enumerate(full):
        e["time"] = t0 + i * 0.001 + float(e["step"])
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in full))
    n = len(steps)
    rows = {
        "step": list(steps),
        "rank": [0] * n,
        "started_at": [t0] * n,
        "time": [t0 + s for s in steps],
        "loss": [(loss or {}).get(s, 2.0 - s / 1000) for s in steps],
        "grad_norm": [0.5] * n,
        "lr": [(lr or {}).get(s, 1e-3) for s in steps],
        "step_time_s": [step_time_s] * n,
        "data_wait_s": [0.0] * n,
        "gc_s": [0.0] * n,
        "skipped": [s in skipped for s in steps],
    }
    (run_dir / METRICS_DIR).mkdir()
    table = conform(pa.table(rows))
    pq.write_table(table, run_dir / METRICS_DIR / f"part-r00000-s{steps[0]:09d}-0.parquet")


def report_of(run_dir: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    """``guardrails report RUN_DIR --no-png FLAGS``, in this process: its stdout."""
    from guardrails.cli import report

    args = argparse.Namespace(run_dir=run_dir, png=None, no_png=True, all=False, json=False)
    for flag in flags:
        setattr(args, flag.lstrip("-"), True)
    assert report.main(args) == 0
    return capsys.readouterr().out


START = {"step": 0, "kind": "start", "run": "r1", "world_size": 1, "device": "cpu"}


def test_failures_count_an_error_end_and_skipped_steps(tmp_path, capsys):
    """An LR blow-up: ten skipped steps, then NonFiniteError. The failures line counts
    them instead of saying "none" beside them."""
    skips = tuple(range(52, 62))
    nonfinite = [
        {
            "step": s,
            "kind": "nonfinite",
            "level": "warning",
            "cause": "optimization_blowup",
            "message": f"non-finite gradients at step {s}, update skipped: a blow-up",
        }
        for s in skips
    ]
    end = {"step": 61, "kind": "end", "error": "NonFiniteError: 10 steps in a row"}
    write_run(tmp_path / "run", [START, *nonfinite, end], range(1, 62), skipped=skips)
    out = report_of(tmp_path / "run", capsys)
    assert "  failures     an error end (step 61), 10 skipped step(s)\n" in out, out
    assert "ended        with an error at step 61" in out
    facts = json.loads(report_of(tmp_path / "run", capsys, "--json"))
    assert facts["failure_counts"] == {
        "verdicts": 0,
        "error_end": 1,
        "skipped_steps": 10,
        "nonfinite_not_skipped": 0,
    }
    # A clean run with nothing wrong still says none; a pre-emption is not a failure.
    end = {"step": 20, "kind": "end", "error": "SystemExit: 143"}
    write_run(tmp_path / "stopped", [START, end], range(1, 21))
    out = report_of(tmp_path / "stopped", capsys)
    assert "  failures     none\n" in out and "stopped by SIGTERM" in out, out


def test_warnings_count_every_warning_the_run_logged(tmp_path, capsys):
    """A warning-level event of a kind the report has no label for (a checkpoint that
    failed its check, a lost loader position) is a warning, not "none" + "other
    events"; a NaN step's warning keeps its own NaN/Inf line."""
    events = [
        START,
        {
            "step": 5,
            "kind": "checkpoint_invalid",
            "level": "warning",
            "message": "checkpoints/step_5 is damaged: skipped",
        },
        {
            "step": 7,
            "kind": "nonfinite",
            "level": "warning",
            "cause": "bad_data",
            "message": "non-finite gradients at step 7, update skipped: a NaN",
        },
        {"step": 9, "kind": "leak", "level": "warning", "message": "grows every step"},
        {"step": 10, "kind": "checkpoint", "path": "checkpoints/step_10"},
        {"step": 10, "kind": "end", "error": None},
    ]
    write_run(tmp_path / "run", events, range(1, 11), skipped=(7,))
    out = report_of(tmp_path / "run", capsys)
    assert "  warnings     2\n" in out, out
    assert "    leak (step 9, rank 0): grows every step" in out
    assert "    checkpoint invalid (step 5, rank 0): checkpoints/step_5 is damaged" in out
    assert "  checkpoints  1: steps 10" in out  # the damaged one is not a save
    assert "other events" not in out
    assert "  NaN/Inf      step 7 rank 0: cause bad_data" in out


def test_a_cpu_loader_on_shared_cores_is_advice_not_a_warning(tmp_path, capsys):
    """The loader's wait on a CPU run whose workers already take every core is told with
    the fast-path advice (an info event), and the run's warnings stay none."""
    events = [
        START,
        {
            "step": 101,
            "kind": "loader_shared_cores",
            "level": "info",
            "message": "over steps 2-101 this rank waited for the loader 40% of the step",
        },
        {"step": 200, "kind": "end", "error": None},
    ]
    write_run(tmp_path / "run", events, range(1, 201))
    out = report_of(tmp_path / "run", capsys)
    assert "  warnings     none\n" in out, out
    assert "  fast path    DataLoader workers on every core of a CPU run" in out, out
    assert "other events" not in out
    # The NaN guard's host read a step under a non-fused optimizer: the same kind of line.
    events.insert(1, {"step": 0, "kind": "nan_guard_syncs", "level": "info", "message": "x"})
    write_run(tmp_path / "syncs", events, range(1, 201))
    out = report_of(tmp_path / "syncs", capsys)
    assert "  warnings     none\n" in out, out
    assert "a host sync a step for the NaN skip (optimizer not fused)" in out, out


def test_a_slowdown_of_a_busy_machine_is_not_listed_as_a_warning(tmp_path, capsys):
    """A slowdown logged as information (other processes held the CPU) is the machine's:
    the warnings line stays none; the loop's own slowdown, a warning, is listed."""
    busy = {
        "step": 120,
        "kind": "slowdown",
        "level": "info",
        "cause": "machine_busy",
        "message": "the loop is not at fault: the machine is busy",
    }
    write_run(tmp_path / "busy", [START, busy, {"step": 200, "kind": "end"}], range(1, 201))
    assert "  warnings     none\n" in report_of(tmp_path / "busy", capsys)
    loop = {**busy, "level": "warning", "cause": "loop", "message": "a step got 3x slower"}
    write_run(tmp_path / "loop", [START, loop, {"step": 200, "kind": "end"}], range(1, 201))
    out = report_of(tmp_path / "loop", capsys)
    assert "  warnings     none\n" not in out and "slowdown" in out, out


def test_durations_are_written_as_people_write_them(tmp_path, capsys):
    from guardrails.cli.report_story import _dur

    assert [_dur(x) for x in (0.000379, 0.309, 0.9996, 8.39, 42.1, 72.0, 200.0, 72 * 60)] == [
        "0.379 ms",
        "309 ms",
        "1 s",
        "8.39 s",
        "42.1 s",
        "72 s",
        "3.3 min",
        "1.2 h",
    ]
    events = [START, {"step": 3, "kind": "end", "error": None}]
    write_run(tmp_path / "run", events, range(1, 4), step_time_s=8.39)
    out = report_of(tmp_path / "run", capsys)
    assert "step time median 8.39 s" in out and "e+0" not in out, out


def test_a_resumed_run_says_which_steps_it_ran(tmp_path, capsys):
    events = [
        START,
        {"step": 60, "kind": "resumed", "path": str(tmp_path / "run/checkpoints/step_60")},
        {"step": 100, "kind": "end", "error": None},
    ]
    write_run(tmp_path / "run", events, range(61, 101))
    out = report_of(tmp_path / "run", capsys)
    assert "  steps        61-100 (40 this run; resumed at 60); 40 metric rows" in out, out


def test_axis_scale_follows_the_span_of_the_values():
    import numpy as np

    from guardrails.cli.report_plot import axis_scale

    healthy = np.linspace(3.0, 1.5, 100)
    assert axis_scale(healthy) == ("linear", {})
    assert axis_scale(np.append(healthy, [np.nan, 4.4e8])) == ("log", {})
    # A loss that can be negative (an ELBO, a reward) cannot go on a log axis.
    scale, kw = axis_scale(np.append(healthy - 2.0, -4.4e8))
    assert scale == "symlog" and 0 < kw["linthresh"] < 1
    assert axis_scale(np.array([np.nan])) == ("linear", {})


@needs_matplotlib
def test_a_loss_blow_up_is_drawn_on_a_log_axis(tmp_path, capsys):
    """One step's loss of 4.4e8 among losses of ~2: on a linear axis every other step
    is a flat line at 0."""
    events = [START, {"step": 40, "kind": "end", "error": None}]
    write_run(tmp_path / "run", events, range(1, 41), loss={30: 4.4e8}, lr={35: 5e3})
    png = tmp_path / "plot.png"
    from guardrails.cli import report

    args = argparse.Namespace(run_dir=tmp_path / "run", png=png, no_png=False, all=False)
    args.json = True
    assert report.main(args) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["plot_scales"] == {"loss": "log", "lr": "log"} and facts["png"] == str(png)
    assert_png(png)
    args.json = False
    assert report.main(args) == 0
    out = capsys.readouterr().out
    assert "(loss and LR on log axes: they span several orders of magnitude)" in out, out
    # A healthy run keeps its linear axis, and says nothing.
    write_run(tmp_path / "ok", events, range(1, 41))
    args.run_dir = tmp_path / "ok"
    assert report.main(args) == 0
    assert "axis" not in capsys.readouterr().out
