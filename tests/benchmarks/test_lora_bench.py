"""benchmarks/lora.py at smoke scale: every scenario runs and is reported against the base model."""

from __future__ import annotations

import json

from benchmarks import lora


def test_lora_benchmark_reports_every_scenario(tmp_path):
    out = tmp_path / "lora.json"
    argv = ["--threads", "1", "--adapters", "1,2", "--num-requests", "4", "--input-len", "8", "--output-len", "4"]
    results = lora.main([*argv, "--repeats", "1", "--layers", "1", "--rank", "8", "--output", str(out)])
    assert set(results["tokens_per_s"]) == {"base", "1 adapters", "2 adapters"}
    assert results["ratio_to_base"]["base"] == 1.0
    assert all(rate > 0 for rate in results["tokens_per_s"].values())
    assert json.loads(out.read_text())["torch_threads"] == 1
