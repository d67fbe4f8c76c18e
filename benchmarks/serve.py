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
    # or start `pagedllm serve` (the demo model unless --serve-args gives --model) for the run
    python -m benchmarks.serve --launch --num-prompts 200 --request-rate 4
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
import socket
import subprocess
import sys
import time

import httpx
from tqdm.asyncio import tqdm

from benchmarks.common import HelpFormatter
from benchmarks.serve_metrics import RequestResult, report, summarize
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


async def run_load(args, model: str, requests) -> tuple[list[RequestResult], float]:
    arrivals = poisson_arrivals(len(requests), args.request_rate, args.seed, args.burstiness)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    pbar = None if args.disable_tqdm else tqdm(total=len(requests), desc="requests")
    async with httpx.AsyncClient(
        base_url=args.base_url, limits=limits, timeout=args.timeout, headers=_auth(args)
    ) as client:
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


# -- launching a server ------------------------------------------------------------------------------------
def launch(args, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `pagedllm serve` (with ``args.serve_args``) on a free loopback port; sets ``args.base_url``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args.base_url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "pagedllm.server.entrypoints.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *args.serve_args.split(),
    ]
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{args.base_url}/ready", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server was not ready within 600 s")


def _auth(args) -> dict:
    key = args.api_key or os.environ.get("PAGEDLLM_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="The server (default: %(default)s).")
    p.add_argument("--launch", action="store_true", help="Start `pagedllm serve` on a free port for the run.")
    p.add_argument("--serve-args", default="", help="Extra `pagedllm serve` flags with --launch, as one string.")
    p.add_argument("--model", default=None, help="Model name to send (default: the server's first model).")
    p.add_argument("--api-key", default=None, help="Bearer key (default: $PAGEDLLM_API_KEY).")
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
    if args.burstiness <= 0:
        p.error(f"--burstiness={args.burstiness} is out of range: must be > 0")
    if args.request_rate <= 0:
        p.error(f"--request-rate={args.request_rate} is out of range: must be > 0 (inf for all at once)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    proc = launch(args) if args.launch else None
    try:
        with httpx.Client(base_url=args.base_url, timeout=120, headers=_auth(args)) as client:
            card = client.get("/v1/models").raise_for_status().json()["data"][0]
            model = args.model or card["id"]
            requests = build_requests(args, token_pool(client), card.get("max_model_len") or 2048)
        results, duration = asyncio.run(run_load(args, model, requests))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    summary = summarize(results, duration)
    text = report(summary, args)
    print(text)
    if args.result_name:
        _save(args, model, summary, text)
    return 0 if summary["completed"] else 1


def _save(args, model: str, summary: dict, text: str) -> None:
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
        "model": model,
        "machine": machine,
        "env": env,
        "args": {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in config.items()},
        "command": prefix + "python -m benchmarks.serve " + " ".join(sys.argv[1:]),
        "summary": summary,
    }
    base = os.path.join(RESULTS_DIR, args.result_name)
    with open(base + ".json", "w") as f:
        json.dump(record, f, indent=2)
    with open(base + ".md", "w") as f:
        f.write(
            f"# Serving benchmark: {args.result_name}\n\n`{record['command']}`\n\n"
            f"Model `{model}`; machine: {machine}\n\n```\n{text}\n```\n"
        )


if __name__ == "__main__":
    sys.exit(main())
