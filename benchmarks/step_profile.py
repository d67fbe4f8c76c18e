"""Where a decode step's time goes in our engine: the throughput benchmark's model and requests
(offline, greedy, fixed output lengths), one engine per batch size, three passes:

1. component clocks: every part of a step wrapped in a wall-clock timer on this engine's own
   objects (scheduler, input preparation, each module of the model, attention's KV write and
   kernel, LM head, sampler, output processing); per step, the rest of each part is its glue
   (Python, views, elementwise ops between modules). Reported as ms per decode step, over
   the steps where the whole batch decodes (no prefill in the step);
2. ``torch.profiler`` over ``--profile-steps`` such steps: the aten operators by self CPU time,
   grouped (matmul, elementwise, copies/indexing, ...); the compiled attention kernel is no
   aten operator and appears in (1) only;
3. ``cProfile`` over the same kind of steps: the Python functions with the most own time.

With ``--vllm-python PATH`` vLLM then runs the same requests with its own torch profiler on
(``benchmarks/vllm_runner.py``, ``profile_dir``): its worker's operators, self CPU time per
profiled step, are reported beside ours (its scheduler and output handling run in other
processes and are not in its steps).

The timers cost about a microsecond each (about 130 per step); pass 1 says how much the
instrumented step is slower than a bare one (``instrumented_over_bare``).

    python -m benchmarks.step_profile --threads 1 --batch-sizes 16,64 --num-requests 32,128 \
        --vllm-python ~/vllm/V/bin/python
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import datetime
import json
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Callable

from benchmarks.common import HelpFormatter, set_threads
from benchmarks.model_shapes import SHAPES, model_vocab
from benchmarks.step_clock import Clock, components, instrument
from benchmarks.throughput import machine, workload, write_model
from benchmarks.vllm_baseline import check_python
from benchmarks.vllm_profile import vllm_profile

# op name -> group, for the torch.profiler pass (anything else: "other")
OP_GROUPS = {
    "matmul": ("aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear"),
    "elementwise": (
        "aten::mul", "aten::add", "aten::sub", "aten::div", "aten::rsqrt", "aten::pow", "aten::mean",
        "aten::silu", "aten::neg", "aten::tanh", "aten::exp", "aten::sum", "aten::argmax", "aten::max",
        "aten::mul_", "aten::add_", "aten::softmax", "aten::_softmax", "aten::log_softmax", "aten::_log_softmax",
    ),
    "copies, indexing, allocation": (
        "aten::copy_", "aten::cat", "aten::index", "aten::index_select", "aten::empty", "aten::empty_like",
        "aten::to", "aten::_to_copy", "aten::contiguous", "aten::clone", "aten::index_put_", "aten::embedding",
        "aten::slice", "aten::select", "aten::view", "aten::reshape", "aten::as_strided", "aten::unsqueeze",
        "aten::stack", "aten::zeros", "aten::fill_", "aten::zero_", "aten::resize_", "aten::t", "aten::transpose",
        "aten::expand", "aten::narrow", "aten::split", "aten::chunk", "aten::_unsafe_view", "aten::full",
        "aten::tensor", "aten::lift_fresh", "aten::detach", "aten::alias", "aten::set_", "aten::scalar_tensor",
        "aten::item", "aten::_local_scalar_dense", "aten::gather", "aten::scatter_", "aten::masked_fill_",
    ),
}  # fmt: skip


def make_engine(model_dir: str, batch: int, threads: int, dtype: str):
    from pagedllm.server import LLM, SamplingParams

    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        max_num_seqs=batch,
        max_model_len=2048,
        cpu_threads=threads,
        dtype=dtype,
    )
    llm.generate([{"prompt_token_ids": list(range(3, 19))}] * 2, SamplingParams(temperature=0, max_tokens=4))
    return llm


def add_requests(engine, requests, tag: str) -> None:
    from pagedllm.server import SamplingParams

    for i, r in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": r.prompt_token_ids}, params)


def bare_decode_ms(engine, requests, batch: int) -> float:
    """Median wall ms of an uninstrumented step in which the whole batch decodes."""
    add_requests(engine, requests, "bare")
    times = []
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        full = len(running) == batch and all(g.seqs[0].num_computed_tokens == len(g.seqs[0]) - 1 for g in running)
        start = time.perf_counter()
        engine.step()
        if full:
            times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e3 if times else float("nan")


def clocked(engine, requests, batch: int) -> tuple[dict[str, float], float, int, dict]:
    """Pass 1: mean ms per full-batch decode step of each component; the step's total; the count."""
    clock = Clock()
    instrument(engine, clock)
    step = clock.timed("engine.step", engine.step)
    add_requests(engine, requests, "clock")
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step()
        clock.end_step()
    elapsed = time.perf_counter() - start
    decode = [s for tokens, seqs, s in clock.steps if tokens == seqs == batch]
    parts = [components(s) for s in decode]
    mean = {k: sum(p[k] for p in parts) / len(parts) * 1e3 for k in parts[0]}
    total = sum(s["engine.step"] for s in decode) / len(decode) * 1e3
    prefill_steps = [s for tokens, seqs, s in clock.steps if tokens != seqs]
    share = {
        "steps": len(clock.steps),
        "full_batch_decode_steps": len(decode),
        "steps_with_prefill": len(prefill_steps),
        "time_in_steps_with_prefill_s": sum(s["engine.step"] for s in prefill_steps),
        "time_in_all_steps_s": sum(s["engine.step"] for _, _, s in clock.steps),
        "generate_wall_s": elapsed,
    }
    return mean, total, len(decode), share


def drive(engine, requests, batch: int, steps: int, around: Callable) -> None:
    """Run ``requests``; wrap ``steps`` full-batch decode steps (after the first few) in ``around``."""
    add_requests(engine, requests, f"p{id(around)}")
    seen = 0
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        full = len(running) == batch and all(g.seqs[0].num_computed_tokens == len(g.seqs[0]) - 1 for g in running)
        if full and 8 <= seen < 8 + steps:
            around(engine.step)
        else:
            engine.step()
        seen += full


def op_profile(engine, requests, batch: int, steps: int) -> tuple[dict[str, float], list[tuple[str, float, int]]]:
    """Pass 2: ms per step of each aten operator group (self CPU time), and the top operators."""
    from torch.profiler import ProfilerActivity, profile

    profiles: list = []

    def profiled(step):
        with profile(activities=[ProfilerActivity.CPU]) as p:
            step()
        profiles.append(p)

    drive(engine, requests, batch, steps, profiled)
    stats: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    for p in profiles:
        for event in p.key_averages():
            if event.key.startswith("aten::"):
                stats[event.key] += event.self_cpu_time_total / 1e3
                calls[event.key] += event.count
    n = len(profiles)
    groups: collections.Counter[str] = collections.Counter()
    for name, ms in stats.items():
        groups[next((g for g, names in OP_GROUPS.items() if name in names), "other")] += ms / n
    top = [(name, ms / n, calls[name] // n) for name, ms in stats.most_common(15)]
    return dict(groups), top


def python_profile(engine, requests, batch: int, steps: int) -> list[tuple[str, float, int]]:
    """Pass 3: the functions with the most own time over ``steps`` decode steps (ms per step)."""
    prof = cProfile.Profile()

    def around(step):
        prof.enable()
        step()
        prof.disable()

    drive(engine, requests, batch, steps, around)
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = []
    for (file, line, name), (_, ncalls, tottime, _, _) in stats.items():
        where = f"{os.path.relpath(file) if file.startswith('/') else file}:{line}({name})"
        rows.append((where, tottime / steps * 1e3, ncalls // steps))
    rows.sort(key=lambda r: -r[1])
    return rows[:20]


def profile_batch(model_dir: str, batch: int, num: int, threads: int, args) -> dict:
    requests = workload("fixed", num, args)
    llm = make_engine(model_dir, batch, threads, args.dtype)
    engine, first = llm.llm_engine, requests[:batch]  # NOTE: passes 0, 2, 3 need only one full batch
    bare = bare_decode_ms(engine, first, batch)
    groups, top_ops, top_python = {}, [], []
    if args.profile_steps > 0:  # NOTE: 0 skips passes 2 and 3 (a quicker run of the clocks alone)
        groups, top_ops = op_profile(engine, first, batch, args.profile_steps)
        top_python = python_profile(engine, first, batch, args.profile_steps)
    parts, total, count, share = clocked(engine, requests, batch)  # NOTE: last: it instruments the engine
    llm.shutdown()
    vllm = vllm_profile(model_dir, requests, batch, threads, args) if args.vllm_python else {}
    return vllm | {
        "batch_size": batch,
        "num_requests": num,
        "bare_decode_step_ms": bare,
        "instrumented_decode_step_ms": total,
        "instrumented_over_bare": total / bare,
        "decode_steps_measured": count,
        "components_ms": parts,
        "aten_groups_ms": groups,
        "top_aten_ops": top_ops,
        "top_python_functions": top_python,
        "steps": share,
    }


def report(case: dict) -> str:
    total = case["instrumented_decode_step_ms"]
    lines = [
        f"batch {case['batch_size']}: decode step {case['bare_decode_step_ms']:.2f} ms bare, {total:.2f} ms timed",
        "| component | ms per decode step | share |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {v:.3f} | {v / total:.1%} |" for k, v in case["components_ms"].items()]
    lines += ["", "| aten group (self CPU) | ms per step |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in sorted(case["aten_groups_ms"].items(), key=lambda kv: -kv[1])]
    lines += ["", "| aten operator | ms per step | calls per step |", "|---|---|---|"]
    lines += [f"| {name} | {ms:.3f} | {n} |" for name, ms, n in case["top_aten_ops"]]
    lines += ["", "| Python function (own time) | ms per step | calls per step |", "|---|---|---|"]
    lines += [f"| `{name}` | {ms:.3f} | {n} |" for name, ms, n in case["top_python_functions"]]
    if "vllm_ops_ms_per_step" in case:
        lines += ["", f"vLLM: {case['vllm_step_ms']:.2f} ms per worker step ({case['vllm_profiled_steps']} profiled)"]
        lines += ["| vLLM operator (self CPU) | ms per step | calls per step |", "|---|---|---|"]
        lines += [f"| {name} | {ms:.3f} | {n} |" for name, ms, n in case["vllm_ops_ms_per_step"][:15]]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.step_profile", description=__doc__, formatter_class=HelpFormatter
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPU quota)")
    p.add_argument("--batch-sizes", default="16,64", help="sequences per batch")
    p.add_argument("--num-requests", default="32,128", help="requests per batch size (same order)")
    p.add_argument("--fixed-output", type=int, default=128, help="output tokens per request")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the engine's dtype")
    p.add_argument(
        "--profile-steps", type=int, default=20, help="decode steps under torch.profiler and cProfile (0: neither)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the workload")
    p.add_argument("--vllm-python", default=None, help="python of vLLM's venv: profile vLLM on the same requests too")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"), help="results directory")
    p.add_argument("--result-name", default=None, help="file name in --out (default: step-profile-DATE-Tt.json)")
    p.add_argument(
        "--shape",
        default="bench",
        choices=sorted(s for s in SHAPES if s not in ("llama-7b", "llama-3-8b")),
        help="model shape (benchmarks/model_shapes.py)",
    )
    p.add_argument("--model", default=None, help="a local checkpoint to profile instead of a --shape")
    args = p.parse_args()
    args.max_output = args.fixed_output
    if args.vllm_python:
        try:
            args.vllm_python = check_python(args.vllm_python)
        except ValueError as exc:
            p.error(str(exc))
    return args


def main() -> None:
    args = parse_args()
    threads = set_threads(args.threads)
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "threads": threads,
        "dtype": args.dtype,
        "shape": args.shape if args.model is None else None,
        "model": args.model,
        "load_avg_1m_at_start": os.getloadavg()[0],
        "command": "python -m benchmarks.step_profile " + " ".join(sys.argv[1:]),
        "cases": [],
    }
    name = args.result_name or f"step-profile-{result['date']}-{threads}t.json"
    path = os.path.join(args.out, name)
    os.makedirs(args.out, exist_ok=True)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    counts = [int(n) for n in args.num_requests.split(",")]
    with tempfile.TemporaryDirectory() as model_dir:
        if args.model is None:
            write_model(model_dir, args.shape, args.dtype)
        else:
            model_dir = args.model
        args.vocab = model_vocab(model_dir)  # NOTE: what workload() draws prompt ids from
        for batch, num in zip(batches, counts):
            case = profile_batch(model_dir, batch, num, threads, args)
            result["cases"].append(case)
            print(report(case) + "\n")
            with open(path, "w") as f:
                json.dump(result, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
