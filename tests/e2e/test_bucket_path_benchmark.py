"""benchmarks/bucket_path.py, the script behind docs/measured/gpu.md's "The bucket path, found": it runs on this
machine's CPU (gloo, one rank) as on a GPU, every row it is asked for (one of its ablations, or any strategy wrapped
as the trainer wraps it, `_off` for figures off), interleaved over rounds, and writes its results and a profile."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_bucket_path_benchmark_runs_its_rows_in_rounds(tmp_path):
    rows = ["none", "bucketed_no_views", "torch_ddp_off", "zero2"]
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bucket_path.py"), "--device", "cpu",
                           "--model", "tiny", "--batch", "2", "--context", "32", "--precision", "fp32",
                           "--warmup", "0", "--steps", "1", "--repeat", "2", "--rows", ",".join(rows),
                           "--looked-at", "bucketed", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((tmp_path / "bucket_path.json").read_text())
    assert list(results["rows"]) == rows, results["rows"]
    for row in rows:
        assert len(results["rows"][row]["step_ms_rounds"]) == 2 and results["rows"][row]["step_ms"] > 0, row
    assert "median of 2 rounds" in proc.stdout, proc.stdout
    assert results["looked_at"]["bucketed"]["sync_warnings"] == {}  # CUDA's sync debug mode: nothing on the CPU
    assert "AccumulateGrad" in (tmp_path / "profile_bucketed.txt").read_text()
