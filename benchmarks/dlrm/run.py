"""facebookresearch/dlrm's `dlrm_s_pytorch.py` under guardrails: sparse embeddings.

    .venv/bin/python benchmarks/dlrm/run.py [--dlrm DIR] [--out DIR] [--guardrails DIR]

A hand-run harness (not in CI: DLRM is not on PyPI; it needs scikit-learn and
tensorboard). DLRM's embedding tables are `nn.EmbeddingBag(..., sparse=True)`, so their
gradients are sparse COO tensors: the loop shape of recommendation models. The script
trains on random data on CPU (SGD, 30 iterations of 64), with the guard adopted by
four edits (`adopt()` below: `guard(...).start()` around the training loop's loader,
`close()` after it, and two environment hooks: a NaN planted into the first embedding
table's sparse gradient at an iteration, the final state dict saved), and compares:

- clean: unguarded and guarded, final weights bitwise equal, a finite grad norm
  recorded at every step, no warning;
- nan_sparse: a NaN planted in the sparse gradient at iteration 10 (guard step 11):
  unguarded, every weight tensor ends NaN; guarded, step 11 is skipped and none is.

`--guardrails DIR` imports another checkout's guardrails (the one before sparse
gradients were supported died at its first step with NotImplementedError from
`linalg_vector_norm`). Default DLRM tree: `git archive HEAD` of the mirror.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
MIRROR = Path("/work/.mirror/facebookresearch+dlrm/repo")
ARGS = [
    "--arch-sparse-feature-size=16",
    "--arch-embedding-size=1000-1000-1000",
    "--arch-mlp-bot=13-64-16",
    "--arch-mlp-top=64-1",
    "--data-generation=random",
    "--mini-batch-size=64",
    "--num-batches=30",
    "--print-freq=10",
    "--nepochs=1",
    "--data-size=1920",
]
#: (anchor, replacement): each anchor must occur exactly once in dlrm_s_pytorch.py.
EDITS = [
    (
        "import torch\nimport torch.nn as nn\n",
        "import torch\nimport torch.nn as nn\nimport os\nimport guardrails\n",
    ),
    (
        "                for j, inputBatch in enumerate(train_ld):\n"
        "                    if j == 0 and args.save_onnx:",
        "                _g = None\n"
        '                if os.environ.get("GR_RUN_DIR"):\n'
        "                    _g = guardrails.guard(dlrm, optimizer, train_ld, "
        'run_dir=os.environ["GR_RUN_DIR"], progress=False)\n'
        "                    _g.start()\n"
        "                for j, inputBatch in enumerate(_g if _g is not None else train_ld):\n"
        "                    if j == 0 and args.save_onnx:",
    ),
    (
        "                        # backward pass\n                        E.backward()\n",
        "                        # backward pass\n                        E.backward()\n"
        '                        if j == int(os.environ.get("GR_NAN_AT", -1)):\n'
        '                            dlrm.emb_l[0].weight.grad._values()[0, 0] = float("nan")\n',
    ),
    (
        "                k += 1  # nepochs\n",
        "                if _g is not None:\n"
        "                    _g.close()\n"
        '                if os.environ.get("GR_WEIGHTS"):\n'
        '                    torch.save(dlrm.state_dict(), os.environ["GR_WEIGHTS"])\n'
        "                k += 1  # nepochs\n",
    ),
]


def adopt(tree: Path) -> None:
    script = tree / "dlrm_s_pytorch.py"
    text = script.read_text()
    for anchor, new in EDITS:
        assert text.count(anchor) == 1, f"DLRM changed: {anchor[:60]!r}"
        text = text.replace(anchor, new)
    script.write_text(text)


def train(tree: Path, work: Path, name: str, gr: Path, guarded: bool, nan_at: int | None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(gr), "GR_WEIGHTS": str(work / f"{name}.pt")}
    if guarded:
        env["GR_RUN_DIR"] = str(work / name)
    if nan_at is not None:
        env["GR_NAN_AT"] = str(nan_at)
    got = subprocess.run(
        [sys.executable, "dlrm_s_pytorch.py", *ARGS],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    (work / f"{name}.out").write_text(got.stdout + got.stderr)
    lines = (got.stdout + got.stderr).strip().splitlines()
    run = {"rc": got.returncode, "tail": lines[-1:]}
    errors = [line for line in lines if line.split(":")[0].endswith("Error")]
    if got.returncode:
        run["error"] = errors[-1][:300] if errors else None
    if got.returncode == 0:
        state = torch.load(work / f"{name}.pt")
        run["nan_tensors"] = sum(not torch.isfinite(v).all().item() for v in state.values())
    if guarded and got.returncode == 0:
        import guardrails

        rows = guardrails.read_metrics(work / name).to_pydict()
        from guardrails.metrics.events import read_events

        events = read_events(work / name)
        run["steps"] = len(rows["step"])
        run["skipped"] = [s for s, k in zip(rows["step"], rows["skipped"], strict=True) if k]
        run["finite_norms"] = sum(1 for v in rows["grad_norm"] if v == v and v != float("inf"))
        run["warnings"] = [(e["kind"], e["step"]) for e in events if e["level"] != "info"]
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dlrm", type=Path, help="a DLRM tree (default: the mirror's HEAD)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "dlrm" / "results")
    p.add_argument("--guardrails", type=Path, default=REPO, help="checkout to import")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dlrm-guardrails-"))
    tree = work / "dlrm"
    if a.dlrm is None:
        tree.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(MIRROR), "archive", "HEAD"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    else:
        subprocess.run(["cp", "-r", str(a.dlrm), str(tree)], check=True)
    adopt(tree)
    runs = {
        "clean-unguarded": train(tree, work, "clean-unguarded", a.guardrails, False, None),
        "clean-guarded": train(tree, work, "clean-guarded", a.guardrails, True, None),
        "nan_sparse-unguarded": train(tree, work, "nan_sparse-unguarded", a.guardrails, False, 10),
        "nan_sparse-guarded": train(tree, work, "nan_sparse-guarded", a.guardrails, True, 10),
    }
    clean = runs["clean-guarded"]
    same = "-"
    if runs["clean-unguarded"]["rc"] == 0 and clean["rc"] == 0:
        plain, guarded = (torch.load(work / f"clean-{v}.pt") for v in ("unguarded", "guarded"))
        same = f"{sum(torch.equal(plain[k], guarded[k]) for k in plain)}/{len(plain)}"
    verdict = {
        "clean": same == "11/11"
        and clean["finite_norms"] == clean["steps"] == 30
        and not clean["warnings"],
        "nan_sparse": runs["nan_sparse-unguarded"].get("nan_tensors", 0) > 0
        and runs["nan_sparse-guarded"]["rc"] == 0
        and runs["nan_sparse-guarded"]["skipped"] == [11]
        and runs["nan_sparse-guarded"]["nan_tensors"] == 0,
    }
    result = {"guardrails": str(a.guardrails), "torch": torch.__version__, "runs": runs}
    result["verdict"] = verdict
    result["bitwise_equal_tensors"] = same
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(result, indent=1))
    for name, ok in verdict.items():
        print(f"{name}: {'PASS' if ok else 'FAIL'}")
    for name, run in runs.items():
        print(f"  {name}: {json.dumps(run)}")
    print(f"clean, final weights bitwise equal: {result['bitwise_equal_tensors']}; work dir {work}")


if __name__ == "__main__":
    main()
