"""Tensor-parallel probe: what the driver pays per step to reach the other ranks, and TP=N vs TP=1 throughput.

1. Step message: the id-keyed :class:`SchedulerOutput` of a steady decode step (batch 1,
   64, 256 at a given context: one new token per sequence, no new block) sent to
   ``--tp - 1`` rank processes that acknowledge it, over the TCP channel the engine uses
   (:mod:`pagedllm.server.worker.channel_protocol`) and over one multiprocessing pipe per
   rank (its former local transport); median microseconds of the send and of the round
   trip, their TCP/pipe ratio, bytes, and the driver's thread count.
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
import threading
import time

import torch
from tqdm import tqdm

from benchmarks.common import HelpFormatter, set_threads
from pagedllm.server import LLM, SamplingParams
from pagedllm.server.core.scheduler_output import CachedSeqs, SchedulerOutput
from pagedllm.server.worker.channel_protocol import frame

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def decode_step(batch: int, context: int, block_size: int) -> SchedulerOutput:
    """What the ranks get for a decode step of ``batch`` sequences they know, ``context`` tokens each.

    NOTE: the block tables stay on the ranks; ``block_size`` only matters when a block is added.
    """
    ids = tuple(range(batch))
    cached = CachedSeqs(ids, tuple((i,) for i in ids), ((),) * batch, (False,) * batch, (context - 1,) * batch)
    return SchedulerOutput(
        cached_seqs=cached,
        scheduled_seq_ids=ids,
        num_scheduled_tokens=(1,) * batch,
        num_decodes=batch,
        sample_seq_ids=ids,
    )


def _pipe_reader(conn) -> None:
    while conn.recv() is not None:
        conn.send(time.monotonic_ns())  # NOTE: CLOCK_MONOTONIC is one clock for every process on Linux


def _channel_rank(port: int, rank: int) -> None:
    from pagedllm.server.worker.rank_channel import RankChannel

    channel = RankChannel.connect("127.0.0.1", port, ("hello", rank, 0, os.getpid(), "bench", (0, 0)), 30)
    channel.first(30)
    channel.start()
    while channel.recv()[0] != "shutdown":
        channel.send(("reply", time.monotonic_ns()))


def _time(send, wait, repeats: int) -> dict:
    """Median microseconds: the send alone, until the last rank's loop holds the step (one way: what a
    step costs, as ranks do not answer steps), and until every acknowledgement is back."""
    sends, arrivals, trips = [], [], []
    for _ in range(repeats):
        start = time.monotonic_ns()
        send()
        sent = time.monotonic_ns()
        received = max(wait())
        done = time.monotonic_ns()
        sends.append(sent - start)
        arrivals.append(received - start)
        trips.append(done - start)
    return {
        "send_us": round(statistics.median(sends) / 1e3, 1),
        "one_way_us": round(statistics.median(arrivals) / 1e3, 1),
        "round_trip_us": round(statistics.median(trips) / 1e3, 1),
    }


def pipe_cost(step: SchedulerOutput, ranks: int, repeats: int) -> dict:
    """What the engine paid with one multiprocessing pipe per rank (its former transport)."""
    context = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    for _ in range(ranks):
        parent, child = context.Pipe()
        proc = context.Process(target=_pipe_reader, args=(child,), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    wire = ("step", step.for_other_ranks())
    timed = _time(lambda: [pipe.send(wire) for pipe in pipes], lambda: [pipe.recv() for pipe in pipes], repeats)
    threads = threading.active_count()
    for pipe, proc in zip(pipes, procs):
        pipe.send(None)
        proc.join(timeout=10)
    return {**timed, "driver_threads": threads}


def channel_cost(step: SchedulerOutput, ranks: int, repeats: int) -> dict:
    """What the engine pays now: one TCP channel, the step pickled once and written to every rank."""
    from pagedllm.server.worker.leader_channel import LeaderChannel

    channel = LeaderChannel("127.0.0.1", 0, {rank: 0 for rank in range(1, ranks + 1)})
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_channel_rank, args=(channel.port, r), daemon=True) for r in range(1, ranks + 1)]
    for proc in procs:
        proc.start()
    channel.accept_all(60, lambda layout: None)
    channel.broadcast(("welcome",))
    channel.start()
    wire = ("step", step.for_other_ranks())
    timed = _time(
        lambda: channel.broadcast(wire), lambda: [channel.reply(r, 30)[1] for r in sorted(channel.peers)], repeats
    )
    threads = threading.active_count()
    channel.close(farewell=("shutdown",))
    for proc in procs:
        proc.join(timeout=10)
    return {**timed, "driver_threads": threads}


def message_cost(batch: int, context: int, block_size: int, repeats: int, ranks: int) -> dict:
    """One decode step's message to ``ranks`` other processes: over pipes (before) and TCP (now)."""
    step = decode_step(batch, context, block_size)
    pipe = pipe_cost(step, ranks, repeats)
    tcp = channel_cost(step, ranks, repeats)
    return {
        "batch": batch,
        "context": context,
        "ranks": ranks,
        "bytes": len(frame(("step", step.for_other_ranks()))),
        "pipe": pipe,
        "tcp": tcp,
        "tcp_over_pipe_one_way": round(tcp["one_way_us"] / pipe["one_way_us"], 3),
        "tcp_over_pipe_round_trip": round(tcp["round_trip_us"] / pipe["round_trip_us"], 3),
    }


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
    p.add_argument("--messages-only", action="store_true", help="only the step-message probe (no throughput run)")
    args = p.parse_args(argv)
    set_threads()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    messages = [
        message_cost(b, args.context, 16, args.repeats, args.tp - 1) for b in tqdm((1, 64, 256), desc="step messages")
    ]
    for m in messages:
        print(
            f"batch {m['batch']:>3}: {m['bytes']} bytes to {m['ranks']} rank(s); one way pipe"
            f" {m['pipe']['one_way_us']} us, TCP {m['tcp']['one_way_us']} us (TCP/pipe {m['tcp_over_pipe_one_way']});"
            f" round trip TCP/pipe {m['tcp_over_pipe_round_trip']}; driver threads pipe"
            f" {m['pipe']['driver_threads']}, TCP {m['tcp']['driver_threads']}"
        )
    if args.messages_only:
        return 0
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
