"""Offline throughput, all in one run on the same model and requests: PagedLLM against
``transformers`` static ``generate`` batches, ``transformers``' own continuous batching
(paged cache), and the no-context forward ceiling (what the weights alone allow).

Two workloads, each at every batch size: prompts with ShareGPT's input lengths and
  - fixed:    every output ``--fixed-output`` tokens long;
  - sharegpt: ShareGPT-like output lengths (log-normal, capped at ``--max-output``),
    where a static batch waits for its longest member.
Greedy decoding, EOS ignored, so every system generates exactly the same number of tokens.
Also measures the engine's scheduling overhead per step (scheduler + block manager, no
model) with many running sequences.

    python -m benchmarks.throughput --threads 2
    python -m benchmarks.throughput --threads 1 --systems ours,ceiling
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

import torch

from benchmarks.common import HelpFormatter, set_threads
from benchmarks.hf_baselines import forward_ceiling, run_hf_continuous, run_hf_static
from benchmarks.workloads import Request, sample_requests

MODEL_SHAPE = dict(
    vocab_size=8000,
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=2048,
)
SYSTEMS = ("ours", "hf_static", "hf_continuous", "ceiling")


def save_random_llama(path: str) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL_SHAPE, bos_token_id=0, eos_token_id=1, pad_token_id=2))
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def run_pagedllm(model_dir: str, requests, batch_size: int, threads: int | None = None, dtype: str = "auto") -> float:
    from pagedllm.server import LLM, SamplingParams

    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        max_num_seqs=batch_size,
        max_model_len=2048,
        cpu_threads=threads,
        dtype=dtype,
    )
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == [r.output_len for r in requests]
    return elapsed


def scheduling_overhead_us(num_seqs: int, steps: int, block_size: int = 16) -> float:
    """Median microseconds per step of schedule() + bookkeeping for ``num_seqs`` decoding sequences."""
    from pagedllm.server.config import SchedulerConfig
    from pagedllm.server.core.block_manager import BlockManager
    from pagedllm.server.core.scheduler import Scheduler
    from pagedllm.server.core.sequence import Sequence, SequenceGroup
    from pagedllm.server.sampling_params import SamplingParams

    bm = BlockManager(block_size, num_seqs * 64, 0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs)), bm)
    for i in range(num_seqs):
        sched.add(SequenceGroup(str(i), [Sequence(i, list(range(161)))], SamplingParams(), arrival_time=i))
    times = []
    for step in range(steps + 64):  # the first steps prefill; time the decode steps
        t0 = time.perf_counter()
        out = sched.schedule()
        sched.mark_computed(out)
        for item in out.scheduled:
            for seq in item.group.seqs:
                if seq.num_computed_tokens == len(seq):
                    seq.append_token(5, 0.0, None)
        sched.free_finished()
        if step >= 64:
            times.append(time.perf_counter() - t0)
    assert len(sched.running) == num_seqs
    times.sort()
    return times[len(times) // 2] * 1e6


def workload(name: str, num: int, args) -> list[Request]:
    """ShareGPT input lengths; outputs fixed or ShareGPT-like (see the module docstring)."""
    requests = sample_requests("sharegpt", num, MODEL_SHAPE["vocab_size"], args.seed, max_output=args.max_output)
    if name == "fixed":
        return [Request(r.prompt_token_ids, args.fixed_output) for r in requests]
    return requests


def run_case(
    model_dir: str, requests: list[Request], batch: int, systems: list[str], threads: int, dtype: str = "auto"
) -> dict:
    """Output tokens/s of each system on ``requests`` at ``batch`` sequences at a time."""
    tokens = sum(r.output_len for r in requests)
    runners = {
        "ours": lambda: run_pagedllm(model_dir, requests, batch, threads, dtype),
        "hf_static": lambda: run_hf_static(model_dir, requests, batch),
        "hf_continuous": lambda: run_hf_continuous(model_dir, requests, batch),
    }
    rates: dict[str, float] = {}
    for name in systems:
        if name == "ceiling":
            rates[name] = forward_ceiling(model_dir, batch)
        else:
            rates[name] = tokens / runners[name]()
        print(f"  {name:14s} {rates[name]:8.1f} tokens/s")
    return rates


def ratios(rates: dict[str, float]) -> dict[str, float]:
    ours = rates.get("ours")
    if ours is None:
        return {}
    return {f"ours_over_{name}": ours / rate for name, rate in rates.items() if name != "ours"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.throughput", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPU quota)")
    parser.add_argument("--batch-sizes", default="16,64", help="sequences per batch, for every system")
    parser.add_argument("--num-requests", default="32,64", help="requests per batch size (same order)")
    parser.add_argument("--workloads", default="fixed,sharegpt", help="output-length workloads to run")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"which of {SYSTEMS} to run")
    parser.add_argument("--fixed-output", type=int, default=128, help="output tokens per request (fixed)")
    parser.add_argument("--max-output", type=int, default=512, help="longest output (sharegpt)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="PagedLLM's dtype (auto: the float32 checkpoint's); the transformers baselines run float32",
    )
    parser.add_argument("--overhead-seqs", type=int, default=256, help="sequences in the scheduler-overhead probe")
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results"), help="directory the results are written to"
    )
    return parser.parse_args()


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, device cpu"


def main() -> None:
    args = parse_args()
    threads = set_threads(args.threads)
    systems = args.systems.split(",")
    overhead = scheduling_overhead_us(args.overhead_seqs, steps=200)
    print(f"scheduling overhead: {overhead:.0f} us/step at {args.overhead_seqs} running sequences (no model)")
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "threads": threads,
        "dtype": args.dtype,
        "fixed_output": args.fixed_output,
        "max_output": args.max_output,
        "cases": [],
        "scheduling_overhead_us_per_step": overhead,
        "overhead_running_seqs": args.overhead_seqs,
        "command": "python -m benchmarks.throughput " + " ".join(sys.argv[1:]),
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"throughput-{result['date']}-cpu{os.cpu_count()}-{threads}t.json")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    counts = [int(n) for n in args.num_requests.split(",")]
    with tempfile.TemporaryDirectory() as model_dir:
        result["model_params"] = save_random_llama(model_dir)
        for name in args.workloads.split(","):
            for batch, num in zip(batches, counts):
                result["cases"].append(run_workload(model_dir, name, batch, num, systems, threads, args))
                save(result, path)  # NOTE: after every case, so a run cut short keeps what it measured
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")


def run_workload(model_dir: str, name: str, batch: int, num: int, systems: list[str], threads: int, args) -> dict:
    requests = workload(name, num, args)
    out_tokens = sum(r.output_len for r in requests)
    mean_input = sum(len(r.prompt_token_ids) for r in requests) / num
    print(
        f"\n{name} outputs, batch {batch}: {num} requests, {out_tokens} output tokens, "
        f"mean input {mean_input:.0f}, {threads} thread(s)"
    )
    rates = run_case(model_dir, requests, batch, systems, threads, args.dtype)
    case = dict(workload=name, batch_size=batch, num_requests=num, output_tokens=out_tokens, mean_input=mean_input)
    return case | {"tokens_per_s": rates} | ratios(rates)


def save(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
