"""Where the time goes when the KV budget limits the batch: a 16-bit cache against an 8-bit one.

Serves the throughput benchmark's ``fixed`` workload (ShareGPT-like prompts, a fixed output
length, all requests at once, greedy) with our engine at a fixed ``--kv-cache-memory`` and
splits every step into what it did and what it cost:

    blocks           the device blocks the budget bought (the engine's, as its metrics report)
    running          sequences in the batch, averaged over decode-only steps
    preemptions      groups preempted (recompute: their prompt and output are prefilled again)
    prefill tokens   prompt tokens computed, recomputed ones included (``recomputed``)
    decode / prefill time and steps; ms per decode step and per decoded token

The output rate of a run is ``output tokens / (prefill time + decode time)``: the 8-bit cache
can shorten only the decode part (more sequences per step) and the recomputation, so the
prefill share bounds what it gains. ``--schedule-only`` runs the same schedule (the blocks
``--shape`` gets from the budget, the same prompt lengths) on the tiny demo model: the
counts in seconds, the timings of no use. Timings are wall time on a shared machine: the counts
(blocks, running, preemptions, tokens) do not depend on load, the seconds do; CPU seconds
(this process's, all threads) less so, since time spent descheduled is not counted.

    python -m benchmarks.kv_budget --shape qwen2.5-0.5b --kv-cache-memory 0.02 \\
        --kv-cache-dtypes auto,int8 --num-requests 64 --batch-size 64
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from benchmarks.common import HelpFormatter, set_threads
from benchmarks.model_shapes import SHAPES, model_vocab, write_random_model
from benchmarks.workloads import Request, sample_requests
from pagedllm.server.demo import save_tiny_llama

CPU_BLOCK_SIZE = 64
"""The engine's block size on the CPU (``DEFAULT_BLOCK_SIZES``), which ``--schedule-only`` keeps."""
RATIO_KEYS = (
    "blocks",
    "mean_running_decode",
    "preemptions",
    "output_tokens_per_s",
    "output_tokens_per_cpu_s",
    "ms_per_decoded_token",
    "cpu_ms_per_decoded_token",
)


@dataclass
class BudgetRun:
    """One cache format's run over the requests (counts exact, seconds measured)."""

    kv_cache_dtype: str
    blocks: int
    output_tokens: int
    seconds: float
    cpu_seconds: float = 0.0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    decode_cpu_seconds: float = 0.0
    decode_running_sum: int = 0
    prefill_steps: int = 0
    prefill_seconds: float = 0.0
    prefill_cpu_seconds: float = 0.0
    prefill_tokens: int = 0
    recomputed_tokens: int = 0
    preemptions: int = 0

    def summary(self) -> dict:
        decoded = max(1, self.decode_running_sum)
        return asdict(self) | {
            "output_tokens_per_s": self.output_tokens / self.seconds if self.seconds else 0.0,
            "output_tokens_per_cpu_s": self.output_tokens / self.cpu_seconds if self.cpu_seconds else 0.0,
            "cpu_ms_per_decoded_token": 1e3 * self.decode_cpu_seconds / decoded,
            "mean_running_decode": self.decode_running_sum / max(1, self.decode_steps),
            "ms_per_decode_step": 1e3 * self.decode_seconds / max(1, self.decode_steps),
            "ms_per_decoded_token": 1e3 * self.decode_seconds / decoded,
            "prefill_share": self.prefill_seconds / self.seconds if self.seconds else 0.0,
        }


def fixed_requests(num: int, vocab: int, output: int, max_input: int = 1024, seed: int = 0) -> list[Request]:
    """The throughput benchmark's ``fixed`` workload: ShareGPT prompts, ``output`` tokens each."""
    requests = sample_requests("sharegpt", num, vocab, seed, max_input=max_input)
    return [Request(r.prompt_token_ids, output) for r in requests]


def serve(model_dir: str, requests: Sequence[Request], kv_cache_dtype: str, args) -> BudgetRun:
    """All ``requests`` at once through one engine; each step classified and timed."""
    from pagedllm.server import LLM, SamplingParams

    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        max_num_seqs=args.batch_size,
        max_model_len=2048,
        cpu_threads=args.threads,
        dtype=args.dtype,
        kv_cache_dtype=kv_cache_dtype,
        preemption_mode=args.preemption_mode,
        **_cache_size(args, kv_cache_dtype),
    )
    engine = llm.llm_engine
    engine.warm_up()
    for i, r in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(str(i), {"prompt_token_ids": r.prompt_token_ids}, params)
    run = BudgetRun(kv_cache_dtype, engine.block_manager.gpu.num_blocks, sum(r.output_len for r in requests), 0.0)
    prompt_tokens, done = sum(len(r.prompt_token_ids) for r in requests), 0
    start, cpu_start = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        queued = [*engine.scheduler.running, *engine.scheduler.waiting]
        before = {id(s): (s.num_computed_tokens, len(s.token_ids)) for g in queued for s in g.seqs}
        step_start, step_cpu = time.perf_counter(), time.process_time()
        finished = sum(o.finished for o in engine.step())
        spent = (time.perf_counter() - step_start, time.process_time() - step_cpu)
        _classify(run, engine, before, spent, finished)
        done += finished
        if args.progress and (run.decode_steps + run.prefill_steps) % 100 == 1:
            running = len(engine.scheduler.running)
            print(f"  {kv_cache_dtype}: {done}/{len(requests)} done, {running} running", flush=True)
    run.seconds, run.cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    run.recomputed_tokens = run.prefill_tokens - prompt_tokens
    run.preemptions = engine.scheduler.num_preemptions
    llm.shutdown()
    return run


def shape_blocks(shape: str, dtype: str, kv_cache_dtype: str, gib: float, block_size: int) -> int:
    """The device blocks ``gib`` of KV cache holds for ``shape`` (what the engine computes: K and V
    rows of every layer and KV head, int8 rows with their scale)."""
    import torch

    from pagedllm.kernels.kv_quant import cache_dtype, row_width

    config = SHAPES[shape]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    cache = cache_dtype(kv_cache_dtype, getattr(torch, dtype))
    row_bytes = row_width(cache, head_dim) * cache.itemsize
    block_bytes = 2 * config["num_hidden_layers"] * block_size * config["num_key_value_heads"] * row_bytes
    return int(gib * 2**30 // block_bytes)


def _cache_size(args, kv_cache_dtype: str) -> dict:
    """The real budget; with ``--schedule-only`` the blocks ``--shape`` would get, on the tiny model."""
    if not args.schedule_only:
        return {"kv_cache_memory": args.kv_cache_memory}
    blocks = shape_blocks(args.shape, args.dtype, kv_cache_dtype, args.kv_cache_memory, CPU_BLOCK_SIZE)
    return {"num_gpu_blocks_override": blocks, "block_size": CPU_BLOCK_SIZE}


def _classify(
    run: BudgetRun, engine, before: dict[int, tuple[int, int]], spent: tuple[float, float], finished: int
) -> None:
    """A step that computed any prompt token (a sequence with more than its last sampled token
    to compute: a prompt, or a preempted sequence recomputed) is a prefill step; else a decode
    step of the sequences that got a token (those still queued, and the ``finished`` ones that left).
    ``before``: each queued sequence's computed tokens and length as the step began. NOTE: a
    prompt whose last chunk is one token computes it as a decode would, and is counted so."""
    groups = [*engine.scheduler.running, *engine.scheduler.waiting]
    prefill = decoded = 0
    for seq in (s for g in groups for s in g.seqs if id(s) in before):
        computed, length = before[id(seq)]
        delta = seq.num_computed_tokens - computed
        if delta <= 0:  # preempted this step (recompute starts it over) or not scheduled
            continue
        if length - computed > 1:
            prefill += delta
        else:
            decoded += delta
    if prefill:
        run.prefill_steps += 1
        run.prefill_seconds += spent[0]
        run.prefill_cpu_seconds += spent[1]
        run.prefill_tokens += prefill
    else:
        run.decode_steps += 1
        run.decode_seconds += spent[0]
        run.decode_cpu_seconds += spent[1]
        run.decode_running_sum += decoded + finished


def torch_version() -> str:
    import torch

    return torch.__version__


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kv_budget", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES), help="model shape")
    parser.add_argument("--dtype", default="bfloat16", help="the model's dtype")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--kv-cache-memory", type=float, default=0.02, help="GiB of KV cache")
    parser.add_argument("--kv-cache-dtypes", default="auto,int8", help="cache formats to run, comma-separated")
    parser.add_argument("--num-requests", type=int, default=64, help="requests, all queued at once")
    parser.add_argument("--batch-size", type=int, default=64, help="max_num_seqs")
    parser.add_argument("--output", type=int, default=128, help="output tokens per request")
    parser.add_argument("--max-input", type=int, default=1024, help="longest prompt, in tokens")
    parser.add_argument(
        "--schedule-only",
        action="store_true",
        help="the tiny model with the blocks --shape gets: exact counts in seconds, timings meaningless",
    )
    parser.add_argument("--preemption-mode", default=None, help="recompute or swap (default: the engine's)")
    parser.add_argument("--progress", action="store_true", help="print progress every 100 steps")
    parser.add_argument("--out", default=None, help="write the JSON here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    set_threads(args.threads)
    with tempfile.TemporaryDirectory() as model_dir:
        if args.schedule_only:
            save_tiny_llama(model_dir, max_position_embeddings=4096)
        else:
            write_random_model(model_dir, args.shape, args.dtype)
        requests = fixed_requests(args.num_requests, model_vocab(model_dir), args.output, args.max_input)
        runs = {}
        for name in args.kv_cache_dtypes.split(","):
            runs[name] = serve(model_dir, requests, name, args).summary()
            print(json.dumps(runs[name]), flush=True)
    base = runs[next(iter(runs))]
    ratios = {name: {k: run[k] / base[k] if base[k] else None for k in RATIO_KEYS} for name, run in runs.items()}
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch_version()}, cpu",
        "command": "python -m benchmarks.kv_budget " + " ".join(sys.argv[1:]),
        "load_avg_1m_at_end": os.getloadavg()[0],
        "args": vars(args),
        "runs": runs,
        "ratios_to_first": ratios,
    }
    print(json.dumps(ratios, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
