"""Soak test: many mixed requests against a server, then proof that nothing leaked.

N requests (default 10,000) at concurrency C, each with random parameters (completion or
chat, n / best_of, beam search, stop strings, logprobs, streaming or not), a share of
them invalid (expect 4xx), a share disconnecting mid-stream or timing out on the client,
and a share carrying an injected fault (expect 500 or a stream error event; the server is
started with ``PAGEDLLM_INJECT_FAULTS=request=poison`` and the fault-injecting worker double
under ``--launch``).

Afterwards it waits for the server to drain and checks, exiting non-zero on a failure:

- no KV block is still held (``pagedllm:kv_blocks_in_use`` back to 0);
- no 5xx other than the injected faults, no transport error other than the intended ones;
- the server's RSS grew by at most ``--max-rss-growth-mib`` after the warm-up share.

    python -m benchmarks.soak --launch --num-requests 10000 --concurrency 32
    python -m benchmarks.soak --base-url http://127.0.0.1:8000 --server-pid 1234
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
from tqdm.asyncio import tqdm

from benchmarks.common import HelpFormatter
from benchmarks.servers import launch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
POISON = "poison"
WORDS = "the of and to in is for on that with as are by this be from at or an it".split()
INVALID = [
    {"temperature": -1.0},
    {"top_p": 2.0},
    {"n": 0},
    {"max_tokens": 0},
    {"logprobs": 99},
    {"model": "no-such-model"},
    {"stop_token_ids": [10**9]},
    {"prompt": []},
    {"stop": ["s"] * 40},
    {"seed": "x"},
]


@dataclass
class Outcome:
    kind: str  # "ok", "invalid", "fault", "disconnect"
    status: int | None = None
    latency: float = 0.0
    error: str = ""
    stream_error: bool = False


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)

    def add(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)

    def status_classes(self) -> dict[str, int]:
        counts: Counter[str] = Counter()
        for o in self.outcomes:
            counts["transport" if o.status is None else f"{o.status // 100}xx"] += 1
        return dict(sorted(counts.items()))


def random_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))


def random_body(rng: random.Random, model: str) -> tuple[str, dict]:
    """A valid request: (path, body)."""
    body: dict = {"model": model, "max_tokens": rng.randint(1, 24), "ignore_eos": rng.random() < 0.5}
    choice = rng.random()
    if choice < 0.15:
        width = rng.randint(2, 3)
        body.update(use_beam_search=True, best_of=width, n=rng.randint(1, width), temperature=0.0)
    elif choice < 0.45:
        n = rng.randint(1, 3)
        body.update(n=n, best_of=n + rng.randint(0, 1), temperature=rng.uniform(0.3, 1.2), seed=rng.randint(0, 99))
    else:
        body.update(temperature=rng.choice([0.0, 0.7]))
    if rng.random() < 0.3:
        body["stop"] = rng.sample(WORDS, rng.randint(1, 3))
    stream = rng.random() < 0.5 and body.get("best_of", 1) == body.get("n", 1) and not body.get("use_beam_search")
    body["stream"] = stream
    if rng.random() < 0.5:
        body["prompt"] = random_prompt(rng)
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 5)
        return "/v1/completions", body
    body["messages"] = [{"role": "user", "content": random_prompt(rng)}]
    if rng.random() < 0.3:
        body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
    return "/v1/chat/completions", body


async def one(client: httpx.AsyncClient, rng: random.Random, i: int, args, model: str) -> Outcome:
    path, body = random_body(rng, model)
    roll = rng.random()
    headers = {"X-Request-Id": f"soak-{i}"}
    kind = "ok"
    if roll < args.invalid_share:
        kind, body = "invalid", {**body, **rng.choice(INVALID)}
        if "prompt" in body and path != "/v1/completions":
            path = "/v1/completions"
    elif roll < args.invalid_share + args.fault_share:
        kind, headers = "fault", {"X-Request-Id": f"{POISON}-{i}"}
    elif roll < args.invalid_share + args.fault_share + args.disconnect_share:
        kind = "disconnect"
    start = time.perf_counter()
    try:
        if kind == "disconnect":
            streamable = {k: v for k, v in body.items() if k not in ("n", "best_of", "use_beam_search")}
            return await disconnect(client, rng, path, {**streamable, "stream": True}, headers)
        if body.get("stream"):
            async with client.stream("POST", path, json=body, headers=headers) as response:
                text = "".join([chunk async for chunk in response.aiter_text()])
            stream_error = '"error"' in text
            error = text[:200] if stream_error or response.status_code != 200 else ""
            return Outcome(kind, response.status_code, time.perf_counter() - start, error, stream_error)
        response = await client.post(path, json=body, headers=headers)
        return Outcome(kind, response.status_code, time.perf_counter() - start, error=response.text[:200])
    except httpx.HTTPError as exc:
        return Outcome(kind, None, time.perf_counter() - start, error=repr(exc))


async def disconnect(client: httpx.AsyncClient, rng: random.Random, path: str, body: dict, headers: dict) -> Outcome:
    """Read a chunk or two of a stream, then hang up."""
    start = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body, headers=headers) as response:
            status = response.status_code
            if status != 200:
                return Outcome(
                    "disconnect", status, time.perf_counter() - start, (await response.aread()).decode()[:200]
                )
            seen = 0
            async for _ in response.aiter_lines():
                seen += 1
                if seen >= rng.randint(1, 3):
                    break
        return Outcome("disconnect", status, time.perf_counter() - start)
    except httpx.HTTPError as exc:
        return Outcome("disconnect", None, time.perf_counter() - start, error=repr(exc))


async def run(args, model: str, pid: int | None) -> tuple[Tally, dict]:
    rng = random.Random(args.seed)
    tally = Tally()
    rss: dict[str, float | None] = {"start": rss_mib(pid)}
    warmup = max(1, int(args.num_requests * 0.05))
    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.client_timeout, limits=limits) as client:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(args.num_requests):
            queue.put_nowait(i)
        bar = tqdm(total=args.num_requests, desc="soak", unit="req")

        async def worker(seed: int) -> None:
            local = random.Random(seed)
            while not queue.empty():
                i = queue.get_nowait()
                tally.add(await one(client, local, i, args, model))
                bar.update(1)
                if len(tally.outcomes) == warmup and "warm" not in rss:
                    rss["warm"] = rss_mib(pid)

        await asyncio.gather(*(worker(rng.randint(0, 1 << 30)) for _ in range(args.concurrency)))
        bar.close()
        blocks = await drained_blocks(client, args.drain_timeout)
    rss["end"] = rss_mib(pid)
    return tally, {"blocks_in_use_after_drain": blocks, "rss_mib": rss}


async def drained_blocks(client: httpx.AsyncClient, timeout: float) -> float | None:
    """``pagedllm:kv_blocks_in_use`` once nothing runs or waits (or at the timeout)."""
    deadline = time.monotonic() + timeout
    values: dict[str, float] = {}
    while time.monotonic() < deadline:
        text = (await client.get("/metrics")).text
        values = {
            name: float(value)
            for name, value in re.findall(r"^pagedllm:(\w+)\{[^}]*\} ([0-9.e+-]+)$", text, re.M)
            if name in ("kv_blocks_in_use", "num_requests_running", "num_requests_waiting", "num_requests_swapped")
        }
        if values and not any(values.values()):
            return 0.0
        await asyncio.sleep(0.2)
    return values.get("kv_blocks_in_use")


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def verdict(tally: Tally, extra: dict, args) -> tuple[dict, list[str]]:
    outcomes = tally.outcomes
    problems = []
    unexpected_5xx = [o for o in outcomes if o.status is not None and o.status >= 500 and o.kind != "fault"]
    lost = [o for o in outcomes if o.status is None and o.kind != "disconnect"]
    wrong_invalid = [o for o in outcomes if o.kind == "invalid" and not (o.status and 400 <= o.status < 500)]
    faults_unreported = [o for o in outcomes if o.kind == "fault" and o.status == 200 and not o.stream_error]
    refused = [o for o in outcomes if o.kind != "invalid" and o.status is not None and 400 <= o.status < 500]
    if extra["blocks_in_use_after_drain"] != 0:
        problems.append(f"{extra['blocks_in_use_after_drain']} KV blocks still in use after the drain")
    if unexpected_5xx:
        problems.append(f"{len(unexpected_5xx)} unexpected 5xx, e.g. {unexpected_5xx[0].error}")
    if lost:
        problems.append(f"{len(lost)} requests lost in transport, e.g. {lost[0].error}")
    if wrong_invalid:
        problems.append(f"{len(wrong_invalid)} invalid requests not answered 4xx, e.g. {wrong_invalid[0].status}")
    if refused:
        problems.append(f"{len(refused)} valid requests answered 4xx, e.g. {refused[0].status} {refused[0].error}")
    if faults_unreported:
        problems.append(f"{len(faults_unreported)} injected faults answered as successes")
    rss = extra["rss_mib"]
    growth = None if rss.get("warm") is None or rss.get("end") is None else rss["end"] - rss["warm"]
    if growth is not None and growth > args.max_rss_growth_mib:
        problems.append(f"RSS grew by {growth:.0f} MiB after warm-up (limit {args.max_rss_growth_mib})")
    ok = [o.latency for o in outcomes if o.kind == "ok" and o.status == 200]
    summary = {
        "requests": len(outcomes),
        "by_status": tally.status_classes(),
        "by_kind": dict(Counter(o.kind for o in outcomes)),
        "injected_faults_reported": sum(1 for o in outcomes if o.kind == "fault" and (o.status or 0) >= 500)
        + sum(1 for o in outcomes if o.kind == "fault" and o.stream_error),
        "p50_latency_s": round(percentile(ok, 0.5), 4),
        "p99_latency_s": round(percentile(ok, 0.99), 4),
        "rss_growth_after_warmup_mib": None if growth is None else round(growth, 1),
        **extra,
    }
    return summary, problems


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to soak (ignored with --launch)")
    p.add_argument("--launch", action="store_true", help="Start `pagedllm serve` (with fault injection) for the run.")
    p.add_argument("--serve-args", default="--max-num-seqs 32", help="Extra `pagedllm serve` flags with --launch.")
    p.add_argument("--server-pid", type=int, default=None, help="PID of the server, to watch its RSS.")
    p.add_argument("--model", default=None, help="Model name to send (default: the server's first).")
    p.add_argument("--num-requests", type=int, default=10_000, help="requests in all")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    p.add_argument("--invalid-share", type=float, default=0.1, help="share of requests that are invalid (expect 4xx)")
    p.add_argument(
        "--fault-share",
        type=float,
        default=0.02,
        help="share of requests with an injected fault (expect 500 or an error event)",
    )
    p.add_argument("--disconnect-share", type=float, default=0.1, help="share of streams the client hangs up on")
    p.add_argument(
        "--client-timeout", type=float, default=300.0, help="seconds before the client gives up on a request"
    )
    p.add_argument(
        "--drain-timeout", type=float, default=120.0, help="seconds to wait for the server to go idle afterwards"
    )
    p.add_argument(
        "--max-rss-growth-mib", type=float, default=256.0, help="most the server's RSS may grow after the warm-up share"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    p.add_argument("--save", action="store_true", help=f"Write the result under {RESULTS_DIR}.")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.launch:  # NOTE: faults come from the test double of the worker, which reads its rules from the env
        args.serve_args += " --worker-cls tests.server.fault_doubles:FaultyWorker"
    server = launch(args, env={"PAGEDLLM_INJECT_FAULTS": f"request={POISON}"}) if args.launch else None
    pid = server.pid if server is not None else args.server_pid
    try:
        model = args.model or httpx.get(f"{args.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        started = time.perf_counter()
        tally, extra = asyncio.run(run(args, model, pid))
        summary, problems = verdict(tally, extra, args)
        summary["duration_s"] = round(time.perf_counter() - started, 1)
        summary["health"] = httpx.get(f"{args.base_url}/health", timeout=30).status_code
        if summary["health"] != 200:
            problems.append(f"/health answered {summary['health']} after the soak")
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    summary["problems"] = problems
    print(json.dumps(summary, indent=2))
    if args.save:
        record = {
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
            "command": "python -m benchmarks.soak " + " ".join(sys.argv[1:]),
            "args": vars(args),
            "summary": summary,
        }
        os.makedirs(RESULTS_DIR, exist_ok=True)
        path = os.path.join(RESULTS_DIR, f"soak-{record['date']}.json")
        with open(path, "w") as f:
            json.dump(record, f, indent=2)
        print(f"saved {path}")
    for problem in problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
