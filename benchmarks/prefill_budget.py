"""The per-step token budget (``max_num_batched_tokens``, the chunked-prefill chunk) on CPU.

For each budget: offline output tokens/s of the same requests, and the longest step,
which is how long running sequences wait for their next token while a prompt chunk is
computed (the inter-token stall a streaming client sees).

    python -m benchmarks.prefill_budget --threads 2 --budgets 256 512 1024 2048
"""

from __future__ import annotations

import argparse
import tempfile
import time

from benchmarks.common import HelpFormatter, set_threads
from benchmarks.model_shapes import BENCH_LLAMA as MODEL_SHAPE
from benchmarks.model_shapes import save_random_llama
from benchmarks.workloads import Request, sample_requests


def run(model_dir: str, requests: list[Request], batch: int, budget: int, threads: int) -> tuple[float, float]:
    """(output tokens/s, longest step in seconds) of PagedLLM with this token budget."""
    from pagedllm.server import LLM, SamplingParams

    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        max_num_seqs=batch,
        max_model_len=2048,
        max_num_batched_tokens=budget,
        cpu_threads=threads,
    )
    engine = llm.llm_engine
    for i, r in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(str(i), {"prompt_token_ids": r.prompt_token_ids}, params)
    longest = 0.0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        longest = max(longest, time.perf_counter() - t0)
    elapsed = time.perf_counter() - start
    return sum(r.output_len for r in requests) / elapsed, longest


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.prefill_budget", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPU quota)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048], help="token budgets")
    parser.add_argument("--batch", type=int, default=32, help="max_num_seqs")
    parser.add_argument("--num-requests", type=int, default=64, help="requests (ShareGPT inputs)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    args = parser.parse_args()
    threads = set_threads(args.threads)
    requests = [
        Request(r.prompt_token_ids, args.output_len)
        for r in sample_requests("sharegpt", args.num_requests, MODEL_SHAPE["vocab_size"], seed=0)
    ]
    print(
        f"{args.num_requests} requests, batch {args.batch}, {args.output_len} output tokens each, {threads} thread(s)"
    )
    with tempfile.TemporaryDirectory() as model_dir:
        save_random_llama(model_dir)
        for budget in args.budgets:
            rate, longest = run(model_dir, requests, args.batch, budget, threads)
            print(f"  budget {budget:5d}: {rate:7.1f} output tokens/s, longest step {longest * 1e3:6.0f} ms")


if __name__ == "__main__":
    main()
