"""Decode throughput against llama.cpp on the same model, in one run: our engine on a
checkpoint and llama.cpp on the GGUF of the same weights, same thread count, and the ratio.

- batch 1: ``llama-bench -p 0 -n N`` (generation from an empty context, its mean tokens/s over
  ``--repeats`` runs) against our engine generating N tokens for a one-token prompt, one
  request at a time (``--repeats`` requests; tokens / wall time);
- batch B > 1: ``llama-server`` with B slots (``-np B``, continuous batching), B requests sent
  at once with the same prompt token ids and ``n_predict`` N (EOS ignored), against our
  engine given the same B requests with ``max_num_seqs`` B. Both: output tokens / wall time
  from the first request sent to the last answer.

llama.cpp is not a dependency: give the binaries of a build (``--llama-bench``,
``--llama-server``). The GGUF must hold the checkpoint's weights (``convert_hf_to_gguf.py
--outtype bf16`` of the ``--model`` directory), so both run the same model and vocabulary.

    python -m benchmarks.llamacpp --threads 2 --model qwen-0.5b \\
        --gguf qwen-0.5b-bf16.gguf --llama-bench llama.cpp/build/bin/llama-bench \\
        --llama-server llama.cpp/build/bin/llama-server --batch-sizes 1,16 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from benchmarks.common import HelpFormatter, set_threads
from benchmarks.throughput import machine, run_pagedllm
from benchmarks.workloads import Request

SERVER_START_S = 300.0
"""How long llama-server may take to load the model and answer ``/health``."""


def bench_command(llama_bench: str, gguf: str, threads: int, n_gen: int, repeats: int) -> list[str]:
    """llama-bench measuring generation only (no prompt), JSON on stdout."""
    return [llama_bench, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(n_gen), "-r", str(repeats), "-o", "json"]


def parse_bench(stdout: str) -> dict:
    """llama-bench's ``-o json`` output -> its generation test: tokens/s (mean, stddev) and what it ran.

    Raises ValueError when the output holds no generation test (``n_gen`` > 0, ``n_prompt`` 0).
    """
    try:
        tests = json.loads(stdout)
    except json.JSONDecodeError as exc:
        raise ValueError(f"llama-bench output is not JSON: {stdout[:200]!r}") from exc
    gen = [t for t in tests if t.get("n_gen", 0) > 0 and t.get("n_prompt", 0) == 0]
    if not gen:
        raise ValueError(f"llama-bench output has no generation test: {[t.get('n_gen') for t in tests]}")
    t = gen[0]
    keys = ("model_type", "model_size", "n_threads", "n_gen", "cpu_info", "build_commit", "type_k", "type_v")
    return {"tokens_per_s": float(t["avg_ts"]), "stddev_tokens_per_s": float(t.get("stddev_ts", 0.0))} | {
        k: t[k] for k in keys if k in t
    }


def server_command(llama_server: str, gguf: str, threads: int, slots: int, slot_ctx: int, port: int) -> list[str]:
    """llama-server with ``slots`` parallel slots of ``slot_ctx`` tokens each, continuous batching on."""
    return [
        llama_server, "-m", gguf, "-t", str(threads), "-np", str(slots), "-c", str(slots * slot_ctx),
        "-cb", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


def completion_body(prompt_token_ids: list[int], n_gen: int) -> dict:
    """A ``/completion`` request: greedy, exactly ``n_gen`` tokens, no reuse of an earlier prompt's cache."""
    return {
        "prompt": prompt_token_ids,
        "n_predict": n_gen,
        "ignore_eos": True,
        "temperature": 0.0,
        "cache_prompt": False,
    }


def parse_completion(answer: dict) -> dict:
    """A ``/completion`` answer -> tokens generated and llama.cpp's own timings (ms)."""
    timings = answer.get("timings", {})
    predicted = answer.get("tokens_predicted", timings.get("predicted_n"))
    if predicted is None:
        raise ValueError(f"completion answer has no token count: {sorted(answer)}")
    return {
        "tokens": int(predicted),
        "prompt_ms": float(timings.get("prompt_ms", 0.0)),
        "predicted_ms": float(timings.get("predicted_ms", 0.0)),
    }


def batch_rate(answers: list[dict], wall_s: float) -> dict:
    """Output tokens/s of a batch of parsed answers that took ``wall_s`` from first sent to last back."""
    tokens = sum(a["tokens"] for a in answers)
    return {"tokens_per_s": tokens / wall_s, "tokens": tokens, "wall_s": wall_s}


def run_llama_bench(args, threads: int) -> dict:
    command = bench_command(args.llama_bench, args.gguf, threads, args.n_gen, args.repeats)
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return parse_bench(done.stdout) | {"command": " ".join(command)}


def run_llama_server(args, threads: int, batch: int, prompt: list[int]) -> dict:
    """Start llama-server, wait for it, send ``batch`` requests at once, stop it."""
    command = server_command(args.llama_server, args.gguf, threads, batch, len(prompt) + args.n_gen + 16, args.port)
    url = f"http://127.0.0.1:{args.port}"
    with open(os.path.join(args.out, "llama-server.log"), "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_ready(url, server)
            _post(url, completion_body(prompt, 4))  # NOTE: warm-up, as our engine gets one
            start = time.perf_counter()
            with ThreadPoolExecutor(batch) as pool:
                answers = list(pool.map(lambda _: _post(url, completion_body(prompt, args.n_gen)), range(batch)))
            wall = time.perf_counter() - start
        finally:
            server.terminate()
            server.wait(timeout=30)
    return batch_rate([parse_completion(a) for a in answers], wall) | {"command": " ".join(command)}


def _wait_ready(url: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"llama-server exited with {server.returncode} (see llama-server.log)")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"llama-server did not answer /health within {SERVER_START_S:.0f} s")


def _post(url: str, body: dict) -> dict:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url + "/completion", data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as r:
        return json.loads(r.read())


def run_ours(args, threads: int, batch: int, prompt: list[int]) -> dict:
    """Our engine on the same requests: one at a time at batch 1 (``--repeats`` of them), else ``batch`` at once."""
    count = args.repeats if batch == 1 else batch
    requests = [Request(list(prompt), args.n_gen) for _ in range(count)]
    measured = run_pagedllm(args.model, requests, batch, threads, args.dtype)
    return {"tokens_per_s": count * args.n_gen / measured.seconds, "wall_s": measured.seconds}


def run_batch(args, threads: int, batch: int) -> dict:
    """One batch size: llama.cpp's rate, ours, and ours over llama.cpp."""
    prompt = [1] if batch == 1 else list(range(100, 100 + args.prompt_len))
    peer = run_llama_bench(args, threads) if batch == 1 else run_llama_server(args, threads, batch, prompt)
    print(f"batch {batch}: llama.cpp {peer['tokens_per_s']:.1f} tokens/s", flush=True)
    ours = run_ours(args, threads, batch, prompt)
    print(f"batch {batch}: ours {ours['tokens_per_s']:.1f} tokens/s", flush=True)
    ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
    return {"batch_size": batch, "prompt_len": len(prompt), "llamacpp": peer, "ours": ours, "ours_over_llamacpp": ratio}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.llamacpp", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--model", required=True, help="our engine's checkpoint (a directory)")
    parser.add_argument("--gguf", required=True, help="the same weights as GGUF, for llama.cpp")
    parser.add_argument("--llama-bench", default="llama-bench", help="llama-bench binary (batch 1)")
    parser.add_argument("--llama-server", default="llama-server", help="llama-server binary (batches > 1)")
    parser.add_argument("--threads", type=int, default=None, help="threads, both systems (default: the CPU quota)")
    parser.add_argument("--batch-sizes", default="1,16", help="concurrent sequences, comma-separated")
    parser.add_argument("--n-gen", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request (batches > 1)")
    parser.add_argument("--repeats", type=int, default=3, help="llama-bench repetitions; our requests at batch 1")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="our engine's dtype")
    parser.add_argument("--port", type=int, default=8093, help="llama-server's port")
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results"), help="directory for the JSON and logs"
    )
    parser.add_argument("--result-name", default=None, help="file name in --out (default: llamacpp-DATE-Tt.json)")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    for name in ("n_gen", "repeats", "prompt_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is out of range: must be >= 1")
    if min(args.batch_sizes) < 1:
        parser.error(f"--batch-sizes={args.batch_sizes} is out of range: each must be >= 1")
    return args


def main() -> None:
    args = parse_args()
    threads = set_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    date = datetime.date.today().isoformat()
    path = os.path.join(args.out, args.result_name or f"llamacpp-{date}-{threads}t.json")
    result = {
        "date": date,
        "machine": machine(),
        "threads": threads,
        "model": args.model,
        "gguf": args.gguf,
        "dtype": args.dtype,
        "n_gen": args.n_gen,
        "command": "python -m benchmarks.llamacpp " + " ".join(sys.argv[1:]),
        "cases": [],
    }
    for batch in args.batch_sizes:
        result["cases"].append(run_batch(args, threads, batch))
        with open(path, "w") as f:  # NOTE: after every case, so a run cut short keeps what it measured
            json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
