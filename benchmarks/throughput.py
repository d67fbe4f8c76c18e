"""Offline throughput: PagedLLM vs Hugging Face ``generate`` with static batches, same run.

Also measures the engine's scheduling overhead per step (scheduler + block manager,
no model) with many running sequences.

    python benchmarks/throughput.py --num-requests 64 --batch-size 32
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
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(__file__))
from common import HelpFormatter, set_threads  # noqa: E402
from workloads import sample_requests  # noqa: E402

MODEL_SHAPE = dict(
    vocab_size=8000,
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=2048,
)


def save_random_llama(path: str) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL_SHAPE, bos_token_id=0, eos_token_id=1, pad_token_id=2))
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def run_pagedllm(model_dir: str, requests, batch_size: int) -> float:
    from pagedllm.server import LLM, SamplingParams

    llm = LLM(model=model_dir, skip_tokenizer_init=True, max_num_seqs=batch_size, max_model_len=2048)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == [r.output_len for r in requests]
    return elapsed


@torch.inference_mode()
def run_hf(model_dir: str, requests, batch_size: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    start = time.perf_counter()
    for i in tqdm(range(0, len(requests), batch_size), desc="hf batches"):
        batch = requests[i : i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.tensor([[2] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch])
        new = max(r.output_len for r in batch)  # a static batch runs until its longest request ends
        model.generate(
            ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=2
        )
    return time.perf_counter() - start


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--workload", default="sharegpt", help="length distribution (the paper's sharegpt or alpaca)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests to run")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per batch, for both systems")
    parser.add_argument("--max-output", type=int, default=1024, help="longest output, in tokens")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload")
    parser.add_argument("--overhead-seqs", type=int, default=256, help="sequences in the scheduler-overhead probe")
    parser.add_argument("--skip-hf", action="store_true", help="only run PagedLLM")
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results"), help="directory the results are written to"
    )
    args = parser.parse_args()
    set_threads()

    overhead = scheduling_overhead_us(args.overhead_seqs, steps=200)
    print(f"scheduling overhead: {overhead:.0f} us/step at {args.overhead_seqs} running sequences (stub model)")
    requests = sample_requests(
        args.workload, args.num_requests, MODEL_SHAPE["vocab_size"], args.seed, max_output=args.max_output
    )
    out_tokens = sum(r.output_len for r in requests)
    with tempfile.TemporaryDirectory() as model_dir:
        params = save_random_llama(model_dir)
        ours = run_pagedllm(model_dir, requests, args.batch_size)
        hf = None if args.skip_hf else run_hf(model_dir, requests, args.batch_size)
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, device cpu",
        "model_params": params,
        "workload": args.workload,
        "num_requests": args.num_requests,
        "batch_size": args.batch_size,
        "mean_input": sum(len(r.prompt_token_ids) for r in requests) / len(requests),
        "mean_output": out_tokens / len(requests),
        "pagedllm_tokens_per_s": out_tokens / ours,
        "hf_tokens_per_s": out_tokens / hf if hf else None,
        "ratio": hf / ours if hf else None,
        "scheduling_overhead_us_per_step": overhead,
        "overhead_running_seqs": args.overhead_seqs,
        "command": "python benchmarks/throughput.py " + " ".join(sys.argv[1:]),
    }
    print(json.dumps(result, indent=2))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"throughput-{result['date']}-cpu-bs{args.batch_size}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
