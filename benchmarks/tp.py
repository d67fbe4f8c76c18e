"""Tensor-parallel probe: what the driver pays per step to reach the other ranks, and TP=N vs TP=1 throughput.

1. Step message: the :class:`ModelStep` of a decode batch (batch 1, 64, 256 at a given
   context) pickled and written to a rank's pipe, as the driver does every step; median
   microseconds and bytes.
2. Throughput: the same requests (random-weight LLaMA, fixed output lengths, greedy)
   offline at ``tensor_parallel_size`` 1 and N; output tokens/s and their ratio. On CPU
   the N ranks share the machine's cores (each gets cores / N threads), so this measures
   the overhead of splitting, not a speed-up; on GPUs each rank has its own device.

    python -m benchmarks.tp --tp 2 --save
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
from tqdm import tqdm

from benchmarks.common import HelpFormatter, set_threads
from pagedllm.server import LLM, SamplingParams
from pagedllm.server.worker.attention import AttentionMetadata
from pagedllm.server.worker.step_inputs import ModelStep

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def decode_step(batch: int, context: int, block_size: int) -> ModelStep:
    blocks = -(-context // block_size)
    tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(batch, dtype=torch.int64) * block_size,
        num_decode_tokens=batch,
        decode_block_tables=tables,
        decode_context_lens=torch.full((batch,), context, dtype=torch.int32),
        prefill_block_tables=torch.zeros(0, 0, dtype=torch.int32),
        prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
        prefill_context_lens=torch.zeros(0, dtype=torch.int32),
    )
    ids = torch.arange(batch, dtype=torch.int64)
    return ModelStep([], [], [], ids, ids.clone(), meta, ids.clone(), None)


def _reader(conn) -> None:
    while conn.recv() is not None:
        pass


def message_cost(batch: int, context: int, block_size: int, repeats: int) -> dict:
    """Median driver-side time to send one step's message down a pipe to another process."""
    parent, child = multiprocessing.get_context("spawn").Pipe()
    reader = multiprocessing.get_context("spawn").Process(target=_reader, args=(child,), daemon=True)
    reader.start()
    step = decode_step(batch, context, block_size)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        parent.send(("step", step.to_wire()))
        times.append(time.perf_counter() - start)
    parent.send(None)
    reader.join(timeout=10)
    from multiprocessing.reduction import ForkingPickler

    size = len(ForkingPickler.dumps(("step", step.to_wire())))
    return {"batch": batch, "context": context, "median_us": round(statistics.median(times) * 1e6, 1), "bytes": size}


def throughput(model_dir: str, tp: int, num_requests: int, prompt_len: int, output_len: int) -> dict:
    with LLM(
        model=model_dir, tensor_parallel_size=tp, load_format="dummy", block_size=16, max_num_seqs=num_requests
    ) as llm:
        prompts = [
            {"prompt_token_ids": [(i * 7 + j) % 200 + 1 for j in range(prompt_len)]} for i in range(num_requests)
        ]
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
        start = time.perf_counter()
        llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        threads = llm.llm_engine.runner.threads
    return {
        "tp": tp,
        "seconds": round(elapsed, 3),
        "output_tok_s": round(num_requests * output_len / elapsed, 1),
        "threads_per_rank": threads.threads,
    }


def tiny_llama(path: str, hidden: int, layers: int, heads: int) -> str:
    from pagedllm.server.demo import save_tiny_llama

    return save_tiny_llama(
        path,
        seed=0,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tp", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size compared with 1")
    p.add_argument("--context", type=int, default=1024, help="context length of the probed decode steps")
    p.add_argument("--repeats", type=int, default=200, help="messages timed per batch size")
    p.add_argument("--hidden", type=int, default=512, help="hidden size of the random LLaMA")
    p.add_argument("--layers", type=int, default=8, help="layers of the random LLaMA")
    p.add_argument("--heads", type=int, default=8, help="attention heads of the random LLaMA")
    p.add_argument("--num-requests", type=int, default=16, help="requests in the throughput run")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    p.add_argument("--save", action="store_true", help="write benchmarks/results/tp-cpu-DATE.json")
    args = p.parse_args(argv)
    set_threads()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    messages = [message_cost(b, args.context, 16, args.repeats) for b in tqdm((1, 64, 256), desc="step messages")]
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_llama(os.path.join(tmp, "llama"), args.hidden, args.layers, args.heads)
        runs = [
            throughput(model, tp, args.num_requests, args.prompt_len, args.output_len)
            for tp in tqdm((1, args.tp), desc="throughput")
        ]
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}, torch {torch.__version__}",
        "command": "python -m benchmarks.tp " + " ".join(sys.argv[1:]),
        "model": f"random LLaMA, hidden {args.hidden}, {args.layers} layers, {args.heads} heads",
        "step_messages": messages,
        "throughput": runs,
        "tp_over_tp1": round(runs[1]["output_tok_s"] / runs[0]["output_tok_s"], 3),
    }
    print(json.dumps(result, indent=2))
    if args.save:
        os.makedirs(RESULTS_DIR, exist_ok=True)
        path = os.path.join(RESULTS_DIR, f"tp-cpu-{result['date']}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
