"""The per-op CPU benchmark runs end to end and reports each op with a speed-up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_it_times_every_op_before_and_after():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.cpu_ops",
            "--threads",
            "1",
            "--dtype",
            "float32",
            "--batch",
            "2",
            "--repeats",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", "PATH": ""},
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()[1:] if line.strip()]
    ops = {row[0] for row in rows}
    assert ops == {"linear", "elementwise"}
    for row in rows:
        before, after, speedup = (float(x) for x in row[-3:])
        assert before > 0 and after > 0
        # Times print to 0.1 µs and the ratio to 0.01, each from the unrounded times: the
        # ratio lies within what the rounded times allow.
        low = (before - 0.05) / (after + 0.05) - 0.005
        high = (before + 0.05) / max(after - 0.05, 1e-9) + 0.005
        assert low <= speedup <= high, (before, after, speedup)
