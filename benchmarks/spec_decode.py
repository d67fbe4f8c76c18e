"""Speculative decoding with n-gram proposals: output tokens/s with and without it, in one run.

Three workloads, each run single-stream (one request at a time) and with 8 at once:

* ``copying``: the benchmark's random-weight LLaMA (benchmarks/throughput.py) given random
  prompts; random weights settle into repeating what they produced, so the continuation
  repeats itself, as a model asked to repeat or edit a given text does;
* ``text``: the embedded demo model (trained) continuing passages of the standard library's
  documentation, greedy: natural text, some of which it repeats;
* ``sampled``: the random-weight LLaMA sampling at temperature 1.0 (seeded): nothing repeats,
  so proposals seldom come and nearly all fail; this measures what speculation costs.

Each configuration is measured ``--repeats`` times, alternating with and without, and the
medians are reported with their ratio and the mean acceptance length (tokens a verifying
step yields: accepted proposals + 1). The machine may be shared: medians, not bests.

    OMP_NUM_THREADS=1 python -m benchmarks.spec_decode --repeats 3
    OMP_NUM_THREADS=1 python -m benchmarks.spec_decode --workloads text \
        --speculative-config '{"method": "draft_model", "model": "DRAFT_DIR", "num_speculative_tokens": 3}'

A draft for the ``text`` workload is a smaller model trained by the demo's own script (same
text, same tokenizer), e.g. ``python -m pagedllm.server.demo.train --out DRAFT_DIR --layers 1
--hidden-size 64 --intermediate-size 128 --heads 2 --kv-heads 1 --steps 300``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass

from benchmarks.common import HelpFormatter, set_threads
from benchmarks.model_shapes import BENCH_LLAMA as MODEL_SHAPE
from benchmarks.model_shapes import save_random_llama
from benchmarks.workloads import sample_requests

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@dataclass
class Workload:
    name: str
    model: str | None  # None: the demo model
    prompts: list[list[int]]
    temperature: float


@dataclass
class Measured:
    tokens_per_s: float
    acceptance_length: float | None  # None without speculation


def doc_prompts(tokenizer, num: int) -> list[list[int]]:
    """Passages of the standard library's documentation (what the demo model was trained on), 64-160 tokens."""
    from pydoc_data.topics import topics

    prompts = []
    for key in sorted(topics):
        ids = tokenizer.encode(topics[key])
        if len(ids) >= 64:
            prompts.append(ids[: 64 + 16 * (len(prompts) % 7)])
        if len(prompts) == num:
            break
    return prompts


def run(llm, prompts: list[list[int]], concurrency: int, max_tokens: int, temperature: float) -> Measured:
    """Output tokens/s keeping ``concurrency`` requests in flight, and the mean acceptance length."""
    from pagedllm.server import SamplingParams

    engine = llm.llm_engine
    before = engine.stats().spec_decode
    queue = list(enumerate(prompts))
    in_flight, tokens = 0, 0
    start = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and in_flight < concurrency:
            i, prompt = queue.pop(0)
            params = SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(f"r{time.monotonic_ns()}-{i}", {"prompt_token_ids": prompt}, params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                tokens += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    after = engine.stats().spec_decode
    if before is None or after is None:
        return Measured(tokens / elapsed, None)
    drafts = after.num_drafts - before.num_drafts
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return Measured(tokens / elapsed, 1.0 + accepted / drafts if drafts else 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.spec_decode", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPU quota)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per configuration (median)")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--num-single", type=int, default=3, help="requests in a single-stream run")
    parser.add_argument("--num-batch", type=int, default=24, help="requests in a batch-8 run (8 in flight)")
    parser.add_argument("--speculative-config", default=None, help=f"JSON (default: {NGRAM})")
    parser.add_argument(
        "--workloads",
        default="copying,text,sampled",
        help="which workloads to run (a draft model must share the workload's vocabulary: text is the demo model's)",
    )
    args = parser.parse_args()
    threads = set_threads(args.threads)
    import json

    from tqdm import tqdm

    from pagedllm.server import LLM

    spec = json.loads(args.speculative_config) if args.speculative_config else NGRAM
    with tempfile.TemporaryDirectory() as tmp:
        save_random_llama(tmp)
        demo = LLM(max_num_seqs=8)
        texts = doc_prompts(demo.llm_engine.tokenizer, max(args.num_single, args.num_batch))
        assert len(texts) == max(args.num_single, args.num_batch), "not enough documentation passages"
        demo.llm_engine.shutdown()
        num = max(args.num_single, args.num_batch)
        randoms = [r.prompt_token_ids[:200] for r in sample_requests("sharegpt", num, MODEL_SHAPE["vocab_size"])]
        workloads = [
            Workload("copying", tmp, randoms, 0.0),
            Workload("text", None, texts, 0.0),
            Workload("sampled", tmp, randoms, 1.0),
        ]
        wanted = args.workloads.split(",")
        unknown = sorted(set(wanted) - {w.name for w in workloads})
        if unknown:
            parser.error(f"--workloads={args.workloads!r} has {unknown}: choose from copying, text, sampled")
        runs = [(w, c) for w in workloads if w.name in wanted for c in (1, 8)]
        results: dict[tuple[str, int, bool], list[Measured]] = {}
        bar = tqdm(total=len(runs) * 2 * args.repeats, desc="spec_decode")
        engines: dict[tuple[str | None, bool], LLM] = {}
        for workload, concurrency in runs:
            prompts = workload.prompts[: args.num_single if concurrency == 1 else args.num_batch]
            for _ in range(args.repeats):
                for speculate in (False, True):
                    key = (workload.model, speculate)
                    if key not in engines:
                        extra = {"speculative_config": spec} if speculate else {}
                        if workload.model is not None:
                            extra["skip_tokenizer_init"] = True  # the random model has no tokenizer
                        engines[key] = LLM(model=workload.model, max_num_seqs=8, cpu_threads=threads, **extra)
                        engines[key].llm_engine.warm_up()
                    measured = run(engines[key], prompts, concurrency, args.max_tokens, workload.temperature)
                    results.setdefault((workload.name, concurrency, speculate), []).append(measured)
                    bar.update()
        bar.close()
    print(f"\nspeculative config: {json.dumps(spec)}; torch threads: {threads}; medians of {args.repeats} runs")
    print(f"{'workload':<10}{'streams':>8}{'plain tok/s':>13}{'spec tok/s':>12}{'ratio':>8}{'accept len':>12}")
    for workload, concurrency in runs:
        plain = statistics.median(m.tokens_per_s for m in results[(workload.name, concurrency, False)])
        specs = results[(workload.name, concurrency, True)]
        fast = statistics.median(m.tokens_per_s for m in specs)
        length = statistics.median(m.acceptance_length or 1.0 for m in specs)
        print(f"{workload.name:<10}{concurrency:>8}{plain:>13.1f}{fast:>12.1f}{fast / plain:>7.2f}x{length:>12.2f}")


if __name__ == "__main__":
    main()
