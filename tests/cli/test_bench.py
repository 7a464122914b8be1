"""`python -m guardrails bench` at a CI size: a well-formed table and JSON."""

from __future__ import annotations

import json

import pytest

from guardrails.__main__ import main


@pytest.mark.slow(reason="the bench command's timed runs: ~2.4 CPU-s")
def test_bench_cli_tiny_on_cpu(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "--device", "cpu", "--size", "tiny", "--batch", "2", "--seq", "16"]
    args += ["--steps", "3", "--warmup", "1", "--repeats", "2", "--json", str(out)]
    assert main([*args, "--variants", "guarded,only:NanGuard,item,isfinite"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].startswith("guardrails bench: tiny")
    for name in ("plain", "guarded", "only:NanGuard", "item", "isfinite"):
        assert f"\n{name} " in text
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"plain", "guarded", "only:NanGuard", "item", "isfinite"}
    assert all(r["step_ms"] > 0 and r["noise_us"] >= 0 for r in rows.values())
    assert rows["plain"]["overhead_us"] == 0 and len(result["times_s"]["guarded"]) == 2
    assert result["size"] == "tiny" and result["world_size"] == 1 and result["params"] > 0


def test_bench_checkpoint_reports_the_save_against_the_disk_floor(tmp_path, capsys):
    disk = tmp_path / "disk"
    assert main(["bench", "--checkpoint", "--dir", str(disk), "--checkpoint-gb", "0.02"]) == 0
    out = capsys.readouterr().out
    assert "disk floor, 1 thread" in out and "disk floor, 8 threads" in out
    assert "guardrails save" in out and "x the floor" in out and "grace period" in out
    assert list(disk.iterdir()) == []  # the floor's file and the save's directory are gone
