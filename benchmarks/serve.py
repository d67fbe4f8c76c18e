"""Online serving benchmark: an async load generator against an OpenAI-compatible server.

Requests arrive as a Poisson process (``--request-rate``; ``--burstiness`` < 1 is burstier,
gamma-distributed gaps as in ``vllm bench serve``), each a streaming ``/v1/completions``
call with token-id prompts whose lengths follow the paper's workloads (``--dataset``).
Metrics use ``vllm bench serve``'s definitions, so the numbers compare:

  request throughput   completed requests / benchmark duration
  output throughput    generated tokens (from usage) / duration
  TTFT                 send -> first streamed chunk with a choice
  TPOT                 per request (e2e latency - TTFT) / (output tokens - 1)
  ITL                  gaps between consecutive streamed chunks, over all requests
  E2EL                 send -> last chunk

    # against a running server
    python -m benchmarks.serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 4
    # or start `pagedllm serve` (the demo model unless --model-path or --serve-args gives one) for the run
    python -m benchmarks.serve --launch --num-prompts 200 --request-rate 4

With ``--vllm-python PATH`` (the python of a venv holding vLLM's CPU build) the benchmark
starts both servers on the same model directory, one at a time on a free loopback port,
and sends each the same load, in turn (ours, vLLM, ours, ... for ``--repeats``); the
results come side by side. ``--client vllm`` measures with vLLM's own client, ``vllm bench
serve`` from that venv (random dataset only), instead of this module's; with ``--launch``
alone that runs vLLM's client against our server. ``--model-path random`` serves the offline
benchmark's random LLaMA (hidden 512, 8 layers, vocabulary 8000) with a BPE tokenizer.

    python -m benchmarks.serve --vllm-python ~/vllm/V/bin/python --client vllm --model-path random \
        --threads 2 --dtype float32 --dataset random --random-input-len 256 --random-output-len 128 \
        --num-prompts 64 --max-concurrency 16 --repeats 2 --result-name serve-vs-vllm
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import random
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from tqdm.asyncio import tqdm

from benchmarks import vllm_baseline
from benchmarks.common import HelpFormatter
from benchmarks.model_shapes import SHAPES
from benchmarks.serve_metrics import RequestResult, median_summary, report, side_by_side, summarize
from benchmarks.servers import launch_ours, launch_vllm, stop_server
from benchmarks.workloads import WORKLOADS, poisson_arrivals, sample_requests

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# -- the workload ---------------------------------------------------------------------------------
def token_pool(client: httpx.Client) -> list[int]:
    """Token ids the server's tokenizer really produces, from a tokenized text (its own docs)."""
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))[:200_000]
    ids = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).raise_for_status()
    return sorted(set(ids.json()["tokens"]))


def build_requests(args, pool: list[int], max_model_len: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    if args.dataset == "random":
        lo = max(1, int(args.random_input_len * (1 - args.random_range_ratio)))
        lo_out = max(1, int(args.random_output_len * (1 - args.random_range_ratio)))
        shapes = [
            (rng.randint(lo, args.random_input_len), rng.randint(lo_out, args.random_output_len))
            for _ in range(args.num_prompts)
        ]
    else:
        shapes = [
            (len(r.prompt_token_ids), r.output_len)
            for r in sample_requests(args.dataset, args.num_prompts, 1, args.seed)
        ]
    requests = []
    for n_in, n_out in shapes:
        n_in = min(n_in, max_model_len // 2)
        n_out = max(1, min(n_out, max_model_len - n_in))
        requests.append(([rng.choice(pool) for _ in range(n_in)], n_out))
    return requests


# -- one request -----------------------------------------------------------------------------------
async def send(
    client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, pbar: tqdm | None
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(prompt_len=len(prompt))
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[len("data: ") :])
                now = time.perf_counter()
                if data.get("choices"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                elif data.get("usage"):
                    result.output_len = data["usage"]["completion_tokens"]
                elif data.get("error"):
                    result.error = data["error"]["message"]
                    return result
        result.latency = last - start
        result.success = True
    except httpx.HTTPError as exc:
        result.error = repr(exc)
    finally:
        if pbar is not None:
            pbar.update(1)
    return result


async def run_load(args, base_url: str, model: str, requests) -> tuple[list[RequestResult], float]:
    arrivals = poisson_arrivals(len(requests), args.request_rate, args.seed, args.burstiness)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    pbar = None if args.disable_tqdm else tqdm(total=len(requests), desc="requests")
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=args.timeout, headers=_auth(args)) as client:
        start = time.perf_counter()

        async def one(at: float, prompt: list[int], max_tokens: int) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if semaphore is None:
                return await send(client, model, prompt, max_tokens, pbar)
            async with semaphore:
                return await send(client, model, prompt, max_tokens, pbar)

        results = await asyncio.gather(*(one(float(t), p, n) for t, (p, n) in zip(arrivals, requests)))
        duration = time.perf_counter() - start
    if pbar is not None:
        pbar.close()
    return list(results), duration


def _auth(args) -> dict:
    key = args.api_key or os.environ.get("PAGEDLLM_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="The server (default: %(default)s).")
    p.add_argument("--launch", action="store_true", help="Start `pagedllm serve` on a free port for the run.")
    p.add_argument("--serve-args", default="", help="Extra `pagedllm serve` flags with --launch, as one string.")
    p.add_argument(
        "--model-path",
        default=None,
        help="Model directory the launched servers serve (default: the demo model); "
        "'random': the offline benchmark's random LLaMA with a tokenizer, written to a temp dir; "
        "a shape of benchmarks/model_shapes.py (qwen2.5-0.5b, ...): that shape's random weights in "
        "--dtype (default bfloat16) with a tokenizer of its vocabulary.",
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads of each launched server (default: its own).")
    p.add_argument("--dtype", default=None, help="--dtype of each launched server (default: its own).")
    p.add_argument("--model", default=None, help="Model name to send (default: the server's first model).")
    p.add_argument("--api-key", default=None, help="Bearer key (default: $PAGEDLLM_API_KEY).")
    p.add_argument(
        "--baseline-python",
        default=None,
        help="python of another PagedLLM checkout's venv (e.g. main's): also launch its `pagedllm serve` as "
        "server 'before', with the same flags, and compare.",
    )
    p.add_argument("--vllm-python", default=None, help="python of vLLM's venv: also serve with `vllm serve`, compare.")
    p.add_argument(
        "--vllm-server",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="With --vllm-python, also serve with `vllm serve` and compare; --no-vllm-server takes only vLLM's "
        "client from that venv (--client vllm).",
    )
    p.add_argument("--vllm-serve-args", default="", help="Extra `vllm serve` flags, as one string.")
    p.add_argument("--vllm-kv-cache-gib", type=float, default=4.0, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE).")
    p.add_argument(
        "--client",
        default="ours",
        choices=["ours", "vllm"],
        help="Load generator: this module's, or `vllm bench serve` from --vllm-python's venv (random dataset).",
    )
    p.add_argument("--repeats", type=int, default=1, help="Runs per server, the servers in turn.")
    p.add_argument(
        "--dataset",
        default="sharegpt",
        choices=[*WORKLOADS, "random"],
        help="Length distribution: the paper's ShareGPT / Alpaca statistics, or uniform random.",
    )
    p.add_argument("--random-input-len", type=int, default=128, help="random dataset: prompt tokens")
    p.add_argument("--random-output-len", type=int, default=128, help="random dataset: output tokens")
    p.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="random: lengths uniform in [len * (1 - ratio), len]."
    )
    p.add_argument("--num-prompts", type=int, default=200, help="requests to send")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Mean arrivals per second (Poisson); inf sends everything at once.",
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Gamma shape of the gaps: 1 = Poisson, < 1 burstier, > 1 more uniform.",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight at once.")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and arrival times")
    p.add_argument("--timeout", type=float, default=600.0, help="Per-request timeout in seconds.")
    p.add_argument("--result-name", default=None, help="Write benchmarks/results/<name>.json and .md.")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    _check(p, args)
    return args


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.burstiness <= 0:
        p.error(f"--burstiness={args.burstiness} is out of range: must be > 0")
    if args.request_rate <= 0:
        p.error(f"--request-rate={args.request_rate} is out of range: must be > 0 (inf for all at once)")
    if args.repeats < 1:
        p.error(f"--repeats={args.repeats} is out of range: must be >= 1")
    if args.vllm_python:
        try:
            args.vllm_python = vllm_baseline.check_python(args.vllm_python)
        except ValueError as exc:
            p.error(str(exc))
        args.launch = True  # NOTE: a comparison starts both servers itself, on the same model directory
    args.vllm_server = bool(args.vllm_python and args.vllm_server)
    if args.vllm_server and args.dtype is None:
        # NOTE: their `auto`s differ: vLLM's runs a float32 checkpoint in bfloat16 on x86, ours in float32
        p.error("comparing with `vllm serve` needs --dtype (float32 or bfloat16), the same for both servers")
    if args.client == "vllm" and not args.vllm_python:
        p.error("--client=vllm runs `vllm bench serve` from vLLM's venv: give --vllm-python")
    if args.client == "vllm" and args.dataset != "random":
        p.error(f"--dataset={args.dataset!r} with --client=vllm: vLLM's client generates only 'random' here")
    if args.client == "vllm" and not args.launch and not args.model_path:
        p.error("--client=vllm against a running server needs --model-path (its tokenizer)")


# -- measuring ------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    # NOTE: a SIGTERM (a timeout, a scheduler) unwinds like Ctrl-C, so the servers started here stop too
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    baselines = [name for name, given in (("before", args.baseline_python), ("vllm", args.vllm_server)) if given]
    servers = ["ours", *baselines]
    runs = []
    with model_directory(args) as args.model_dir, tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        for repeat in range(args.repeats):
            for server in servers:  # NOTE: in turn, so a shared machine's drift hits both alike
                load = os.getloadavg()[0]  # how busy the (shared) machine was as the run started
                model, summary = measure(server, args, tmp)
                text = report(summary, args)
                print(f"\n{server}, run {repeat + 1} of {args.repeats} ({args.client}'s client)\n{text}")
                run = {"server": server, "repeat": repeat, "model": model, "load_avg_1m": load}
                runs.append(run | {"summary": summary})
    medians = {server: median_summary([r["summary"] for r in runs if r["server"] == server]) for server in servers}
    table = side_by_side(runs, medians)
    print("\n" + table)
    if args.result_name:
        _save(args, runs, medians, table)
    return 0 if all(r["summary"]["completed"] for r in runs) else 1


@contextmanager
def model_directory(args) -> Iterator[str | None]:
    """The directory every launched server serves: ``--model-path``, the random LLaMA written to a
    temp dir, the demo model when two servers must share one, or None (each server's default)."""
    if args.model_path == "random" or args.model_path in SHAPES:
        from benchmarks.model_shapes import save_random_llama, write_random_model

        with tempfile.TemporaryDirectory(prefix=f"{args.model_path}-") as path:
            if args.model_path == "random":
                save_random_llama(path, tokenizer=True)
            else:
                write_random_model(path, args.model_path, args.dtype or "bfloat16", tokenizer=True)
            yield path
    elif args.model_path:
        yield os.path.abspath(args.model_path)
    elif args.vllm_python:
        from pagedllm.server.demo import ensure_demo_model

        yield ensure_demo_model()
    else:
        yield None


def measure(server: str, args, tmp: str) -> tuple[str, dict]:
    """Start ``server`` if this run launches it, send the load with ``args.client``'s client, stop it."""
    proc = None
    log_path = os.path.join(tmp, f"{server}.log")
    with open(log_path, "a") as log:
        if server == "vllm":
            print(f"starting vllm serve (its log: {log_path})")
            proc, base_url = launch_vllm(args, log)
        elif server == "before":
            proc, base_url = launch_ours(args, python=args.baseline_python)
        elif args.launch:
            proc, base_url = launch_ours(args)
        else:
            base_url = args.base_url
        try:
            if args.client == "vllm":
                return run_vllm_client(args, base_url, os.path.join(tmp, f"{server}-result.json"), log)
            return run_our_client(args, base_url)
        finally:
            if proc is not None:
                stop_server(proc)


def run_our_client(args, base_url: str) -> tuple[str, dict]:
    with httpx.Client(base_url=base_url, timeout=120, headers=_auth(args)) as client:
        card = client.get("/v1/models").raise_for_status().json()["data"][0]
        model = args.model or card["id"]
        requests = build_requests(args, token_pool(client), card.get("max_model_len") or 2048)
        warm_up(client, model, requests[0][0])
    results, duration = asyncio.run(run_load(args, base_url, model, requests))
    return model, summarize(results, duration)


def warm_up(client: httpx.Client, model: str, prompt: list[int]) -> None:
    """One short request before the timed load, as `vllm bench serve` sends (compiled kernels load on first use)."""
    body = {"model": model, "prompt": prompt[:16], "max_tokens": 4, "temperature": 0.0}
    client.post("/v1/completions", json=body).raise_for_status()


def run_vllm_client(args, base_url: str, result_path: str, log) -> tuple[str, dict]:
    """`vllm bench serve` against ``base_url``; its result in our summary's keys."""
    models = httpx.get(f"{base_url}/v1/models", headers=_auth(args), timeout=30).raise_for_status()
    model = args.model or models.json()["data"][0]["id"]
    print(f"running `vllm bench serve` against {base_url} (its log: {log.name})")
    summary = vllm_baseline.run_bench_serve(args.vllm_python, base_url, model, args.model_dir, result_path, args, log)
    return model, summary


def _save(args, runs: list[dict], medians: dict[str, dict], table: str) -> None:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    machine = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    config = {k: v for k, v in vars(args).items() if k not in ("api_key",)}
    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ}
    prefix = "".join(f"{k}={v} " for k, v in env.items())
    record = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": runs[0]["model"],
        "machine": machine,
        "env": env,
        "args": {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in config.items()},
        "command": prefix + "python -m benchmarks.serve " + " ".join(sys.argv[1:]),
        "client": args.client,
        "summary": medians["ours"],
        "servers": medians,
        "runs": runs,
    }
    base = os.path.join(RESULTS_DIR, args.result_name)
    with open(base + ".json", "w") as f:
        json.dump(record, f, indent=2)
    reports = "\n\n".join(f"{r['server']}, run {r['repeat'] + 1}:\n{report(r['summary'], args)}" for r in runs)
    with open(base + ".md", "w") as f:
        f.write(
            f"# Serving benchmark: {args.result_name}\n\n`{record['command']}`\n\n"
            f"Model `{record['model']}`; machine: {machine}\n\n{table}\n\n```\n{reports}\n```\n"
        )


if __name__ == "__main__":
    sys.exit(main())
