"""The soak benchmark's short version: 300 mixed requests against a served demo model leave nothing behind."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_300_mixed_requests_leak_nothing():
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.soak",
        "--launch",
        "--num-requests",
        "300",
        "--concurrency",
        "16",
        "--serve-args",
        "--max-num-seqs 16",
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=540, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout[done.stdout.index("{") : done.stdout.rindex("}") + 1])
    assert summary["requests"] == 300 and summary["problems"] == []
    assert summary["blocks_in_use_after_drain"] == 0 and summary["health"] == 200
    kinds = summary["by_kind"]
    assert kinds["invalid"] and kinds["disconnect"] and kinds["fault"]
    assert summary["injected_faults_reported"] == kinds["fault"]
    assert summary["by_status"]["4xx"] >= kinds["invalid"]
