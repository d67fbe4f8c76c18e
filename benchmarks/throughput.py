"""Offline throughput, all in one run on the same model and requests: PagedLLM against
``transformers`` static ``generate`` batches, ``transformers``' own continuous batching
(paged cache), the no-context forward ceiling (what the weights alone allow) and, when its
venv is given (``--vllm-python``), vLLM's CPU build.

Two workloads, each at every batch size: prompts with ShareGPT's input lengths and
  - fixed:    every output ``--fixed-output`` tokens long;
  - sharegpt: ShareGPT-like output lengths (log-normal, capped at ``--max-output``),
    where a static batch waits for its longest member.
Greedy decoding, EOS ignored, so every system generates exactly the same number of tokens.
Only generation is timed: loading, compiling and warming up (vLLM does these at start-up;
our engine gets two short requests first) are not. vLLM loads the very checkpoint our
engine loads (random weights saved to a temp dir), gets the same prompt token ids,
``max_num_seqs`` = the batch size and the same thread count; its greedy tokens are
compared with ours (``greedy_mismatches``: requests whose tokens differ).
``--repeats N`` runs every system N times in turn (ours, vLLM, ..., ours, vLLM, ...), so a
shared machine's drift hits all of them alike. Also measures the engine's scheduling
overhead per step (scheduler + block manager, no model) with many running sequences.

    python -m benchmarks.throughput --threads 2
    python -m benchmarks.throughput --threads 1 --systems ours,ceiling
    python -m benchmarks.throughput --threads 2 --systems ours,vllm --vllm-python ~/vllm/V/bin/python \
        --workloads fixed --batch-sizes 16,64 --num-requests 32,128 --repeats 2

``--vllm-dtype float32`` has vLLM run the same checkpoint in float32 while ours runs ``--dtype``:
on a CPU without AVX-512, vLLM's bfloat16 path is far slower than its float32 one. Its greedy
tokens then come from other arithmetic and are not expected to match ours.

``--quantization awq`` writes the shape as an AWQ checkpoint (4-bit, group 128:
:mod:`benchmarks.quant_checkpoint`) that both engines load; run it with ``--systems ours,vllm``.
``--quantization int8`` has ours quantize the plain checkpoint per channel at load (``LLM(quantization=
"int8")``), with ``--systems ours`` only. ``ours_plain`` is our engine on the same shape unquantized
(a plain checkpoint in ``--dtype`` beside the AWQ one; for int8 the checkpoint ours quantizes), run in
turn with the others, so the quantized model's speed-up is a ratio within one run (``ours/ours_plain``,
each repeat's in brackets):

    python -m benchmarks.throughput --threads 2 --systems ours,ours_plain --quantization awq --repeats 3 \
        --shape qwen2.5-0.5b --dtype bfloat16 --workloads fixed --batch-sizes 1,16 --num-requests 4,16

``--shape`` picks the model (:mod:`benchmarks.model_shapes`): the small LLaMA by default, a
real size people serve on CPUs (``qwen2.5-0.5b``, ``qwen2.5-1.5b``, ``llama-3.2-1b``: random
weights saved in ``--dtype``), or ``llama-7b`` (random bf16 weights drawn on the GPU, ~13.5 GB:
the GPU setting). ``--model PATH`` runs a local checkpoint instead.

    python -m benchmarks.throughput --threads 2 --systems ours,vllm --vllm-python V/bin/python \
        --shape qwen2.5-0.5b --dtype bfloat16 --workloads fixed --batch-sizes 1,16 --num-requests 8,32
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from benchmarks.common import HelpFormatter, set_threads
from benchmarks.hf_baselines import forward_ceiling, run_hf_continuous, run_hf_static
from benchmarks.model_shapes import BENCH_LLAMA, SHAPES, model_vocab, save_random_llama, write_random_model
from benchmarks.scheduler_overhead import scheduling_overhead_us
from benchmarks.throughput_report import greedy_check, ratios, run_ratios, table
from benchmarks.vllm_baseline import Job, Result, check_python, run_offline
from benchmarks.workloads import Request, sample_requests

MODEL_SHAPE = BENCH_LLAMA
SYSTEMS = ("ours", "ours_plain", "vllm", "hf_static", "hf_continuous", "ceiling")
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Measured:
    """One system's run over the requests."""

    seconds: float
    token_ids: list[list[int]] | None = None
    """Greedy tokens per request, where the system gives them back."""
    cpu_s: float | None = None
    """CPU time of all the system's processes and threads while it generated. Other work on the
    cores moves it less than wall time: waiting while descheduled costs none (OpenMP threads
    spinning at a barrier do count)."""


def run_pagedllm(
    model_dir: str, requests, batch_size: int, threads: int | None = None, dtype: str = "float32", **engine_args
) -> Measured:
    """How long ``LLM.generate`` takes over ``requests`` (greedy, EOS ignored), and the tokens it
    generated; ``engine_args`` go to the engine (``kv_cache_dtype``, ``kv_cache_memory``)."""
    from pagedllm.server import LLM, SamplingParams

    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        max_num_seqs=batch_size,
        max_model_len=2048,
        cpu_threads=threads,
        dtype=dtype,
        **engine_args,
    )
    # NOTE: vLLM compiles and warms its model up before it serves; this is ours (what the
    # server runs at start-up: the compiled kernels, a prefill and a decode), also left out of the timing
    llm.llm_engine.warm_up()
    llm.generate([{"prompt_token_ids": list(range(3, 19))}] * 2, SamplingParams(temperature=0, max_tokens=4))
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    start, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    llm.shutdown()
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    assert [len(t) for t in token_ids] == [r.output_len for r in requests]
    return Measured(elapsed, token_ids, cpu)


def run_vllm(model_dir: str, requests, batch_size: int, threads: int, args) -> Result:
    """What :func:`run_pagedllm` measures, by vLLM's offline ``LLM`` in its own venv (``args.vllm_python``)."""
    job = Job(
        model=model_dir,
        requests=[(r.prompt_token_ids, r.output_len) for r in requests],
        dtype=args.vllm_dtype or args.dtype,
        max_num_seqs=batch_size,
        max_model_len=2048,
        threads=threads,
        kv_cache_gib=args.vllm_kv_cache_gib,
    )
    print(f"  (vLLM starting in {args.vllm_python}; its log: {args.vllm_log})")
    return run_offline(args.vllm_python, job, args.vllm_log)


def workload(name: str, num: int, args) -> list[Request]:
    """ShareGPT input lengths; outputs fixed or ShareGPT-like (see the module docstring)."""
    requests = sample_requests("sharegpt", num, args.vocab, args.seed, max_output=args.max_output)
    if name == "fixed":
        return [Request(r.prompt_token_ids, args.fixed_output) for r in requests]
    return requests


def run_case(model_dir: str, requests: list[Request], batch: int, systems: list[str], threads: int, args) -> dict:
    """Output tokens/s of each system on ``requests`` at ``batch`` sequences at a time, ``args.repeats``
    times in turn, and how many requests' greedy tokens differ between the engines."""
    tokens = sum(r.output_len for r in requests)
    dtype = getattr(torch, args.dtype)
    extra: dict = {}

    def vllm() -> Measured:
        result = run_vllm(model_dir, requests, batch, threads, args)
        extra["vllm"] = {"version": result.vllm_version, "engine": result.engine}
        return Measured(result.elapsed_s, result.token_ids, result.cpu_s)

    runners = {
        "ours": lambda: run_pagedllm(
            model_dir, requests, batch, threads, args.dtype, quantization=args.quantization, **_cache_args(args)
        ),
        "ours_plain": lambda: run_pagedllm(args.plain_model, requests, batch, threads, args.dtype, **_cache_args(args)),
        "vllm": vllm,
        "hf_static": lambda: Measured(run_hf_static(model_dir, requests, batch, dtype)),
        "hf_continuous": lambda: Measured(run_hf_continuous(model_dir, requests, batch, dtype=dtype)),
        # NOTE: the ceiling is a rate; as seconds, what the tokens would take at that rate
        "ceiling": lambda: Measured(tokens / forward_ceiling(model_dir, batch, dtype=dtype)),
    }
    runs: list[dict] = []
    outputs: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats):
        run: dict[str, dict] = {"tokens_per_s": {}, "cpu_ms_per_token": {}, "load_avg_1m": {}}
        for name in systems:
            run["load_avg_1m"][name] = os.getloadavg()[0]  # NOTE: how busy the shared machine was as it started
            measured = runners[name]()
            run["tokens_per_s"][name] = tokens / measured.seconds
            if measured.cpu_s is not None:
                run["cpu_ms_per_token"][name] = measured.cpu_s / tokens * 1e3
            if measured.token_ids is not None:
                outputs.setdefault(name, measured.token_ids)
            print(f"  {name:14s} {tokens / measured.seconds:8.1f} tokens/s   (run {repeat + 1} of {args.repeats})")
        runs.append(run)
    medians = {name: statistics.median(run["tokens_per_s"][name] for run in runs) for name in systems}
    measured_cpu = runs[0]["cpu_ms_per_token"]
    cpu = {name: statistics.median(run["cpu_ms_per_token"][name] for run in runs) for name in measured_cpu}
    return {"tokens_per_s": medians, "cpu_ms_per_token": cpu, "runs": runs} | greedy_check(outputs) | extra


def _cache_args(args) -> dict:
    """Our engine's KV cache flags, as given (unset: the engine's defaults)."""
    given = {"kv_cache_dtype": args.kv_cache_dtype, "kv_cache_memory": args.kv_cache_memory}
    return {k: v for k, v in given.items() if v is not None}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.throughput", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPU quota)")
    parser.add_argument("--batch-sizes", default="16,64", help="sequences per batch, for every system")
    parser.add_argument("--num-requests", default="32,64", help="requests per batch size (same order)")
    parser.add_argument("--workloads", default="fixed,sharegpt", help="output-length workloads to run")
    parser.add_argument(
        "--systems", default=None, help=f"which of {SYSTEMS} to run (default: all; vllm only with --vllm-python)"
    )
    parser.add_argument(
        "--shape", default="bench", choices=sorted(SHAPES), help="model shape (benchmarks/model_shapes.py)"
    )
    parser.add_argument("--model", default=None, help="a local checkpoint to run instead of a --shape")
    parser.add_argument(
        "--quantization",
        default=None,
        choices=("awq", "int8"),
        help="awq: write and run an AWQ checkpoint; int8: ours quantizes the plain checkpoint per channel at load",
    )
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="weights and activations, every system")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every system per case, in turn")
    parser.add_argument("--kv-cache-dtype", default=None, help="our KV cache's format: auto, fp8, fp8_e5m2, int8")
    parser.add_argument("--kv-cache-memory", type=float, default=None, help="our KV cache's GiB on CPU (1 if unset)")
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vLLM's CPU build: adds vllm")
    parser.add_argument(
        "--vllm-dtype",
        default=None,
        choices=DTYPES,
        help="vLLM's dtype, on the same checkpoint (default: --dtype), e.g. float32 where its bfloat16 path is slow",
    )
    parser.add_argument("--vllm-kv-cache-gib", type=float, default=4.0, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--fixed-output", type=int, default=128, help="output tokens per request (fixed)")
    parser.add_argument("--max-output", type=int, default=512, help="longest output (sharegpt)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload")
    parser.add_argument("--overhead-seqs", type=int, default=256, help="sequences in the scheduler-overhead probe")
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results"), help="directory the results are written to"
    )
    parser.add_argument(
        "--result-name", default=None, help="file name in --out (default: throughput-DATE-cpuN-Tt[-DTYPE].json)"
    )
    args = parser.parse_args()
    args.systems = _systems(parser, args)
    if args.quantization == "int8" and any(s not in ("ours", "ours_plain") for s in args.systems):
        parser.error("--quantization int8 quantizes at load, which only ours does: run it with --systems ours")
    if "ours_plain" in args.systems and (args.quantization is None or (args.model and args.quantization == "awq")):
        parser.error("--systems includes ours_plain, the unquantized peer of --quantization's model on a --shape")
    if args.vllm_dtype is not None and "vllm" not in args.systems:
        parser.error(f"--vllm-dtype={args.vllm_dtype} is vLLM's: add vllm to --systems (and --vllm-python)")
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} is out of range: must be >= 1")
    return args


def _systems(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    default = [s for s in SYSTEMS if (s != "vllm" or args.vllm_python) and (s != "ours_plain" or args.quantization)]
    systems = args.systems.split(",") if args.systems else default
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"--systems={args.systems!r} has {unknown}: choose from {SYSTEMS}")
    if args.vllm_python:
        try:
            args.vllm_python = check_python(args.vllm_python)
        except ValueError as exc:
            parser.error(str(exc))
    elif "vllm" in systems:
        parser.error("--systems includes vllm: give --vllm-python, the python of vLLM's venv")
    return systems


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    if torch.cuda.is_available():
        import triton

        gpu = torch.cuda.get_device_name(0)
        return f"{gpu}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, {cpu}"
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, device cpu"


def write_model(model_dir: str, shape: str, dtype: str = "float32", quantization: str | None = None) -> int:
    """The run's random-weight model in ``model_dir`` (AWQ-quantized if asked); its parameter count."""
    if quantization == "awq":
        from benchmarks.quant_checkpoint import write_awq_model

        return write_awq_model(model_dir, shape, dtype=dtype)
    if shape == "bench":
        return save_random_llama(model_dir)
    if shape == "llama-7b":
        from benchmarks.llama7b import write_llama7b

        return write_llama7b(model_dir, weights=True)
    return write_random_model(model_dir, shape, dtype)


def main() -> None:
    args = parse_args()
    threads = set_threads(args.threads)
    overhead = scheduling_overhead_us(args.overhead_seqs, steps=200)
    print(f"scheduling overhead: {overhead:.0f} us/step at {args.overhead_seqs} running sequences (no model)")
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "threads": threads,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "shape": args.shape if args.model is None else None,
        "model": args.model,
        "systems": args.systems,
        "repeats": args.repeats,
        "kv_cache": _cache_args(args),
        "vllm_python": args.vllm_python,
        "vllm_kv_cache_gib": args.vllm_kv_cache_gib if args.vllm_python else None,
        "vllm_dtype": (args.vllm_dtype or args.dtype) if "vllm" in args.systems else None,
        "fixed_output": args.fixed_output,
        "max_output": args.max_output,
        "cases": [],
        "scheduling_overhead_us_per_step": overhead,
        "overhead_running_seqs": args.overhead_seqs,
        "command": "python -m benchmarks.throughput " + " ".join(sys.argv[1:]),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_", "MKL_"))},
    }
    os.makedirs(args.out, exist_ok=True)
    suffix = "" if args.dtype == "float32" else f"-{args.dtype}"
    suffix += f"-kv-{args.kv_cache_dtype}" if args.kv_cache_dtype not in (None, "auto") else ""
    where = "gpu-" + args.shape if torch.cuda.is_available() else f"cpu{os.cpu_count()}-{threads}t"
    where += "" if args.shape == "bench" or args.model else f"-{args.shape}"
    name = args.result_name or f"throughput-{result['date']}-{where}{suffix}.json"
    path = os.path.join(args.out, name)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    counts = [int(n) for n in args.num_requests.split(",")]
    with (
        tempfile.TemporaryDirectory() as model_dir,
        tempfile.TemporaryDirectory(prefix="vllm-logs-") as logs,
        tempfile.TemporaryDirectory() as plain_dir,
    ):
        args.vllm_log = os.path.join(logs, "vllm.log")
        if args.model is None:
            result["model_params"] = write_model(model_dir, args.shape, args.dtype, args.quantization)
        else:
            model_dir = args.model
        args.plain_model = model_dir
        if "ours_plain" in args.systems and args.quantization == "awq":
            write_model(plain_dir, args.shape, args.dtype)
            args.plain_model = plain_dir
        args.vocab = model_vocab(model_dir)
        for name in args.workloads.split(","):
            for batch, num in zip(batches, counts):
                result["cases"].append(run_workload(model_dir, name, batch, num, threads, args))
                save(result, path)  # NOTE: after every case, so a run cut short keeps what it measured
    print(json.dumps(result, indent=2))
    print(table(result))
    print(f"wrote {path}")


def run_workload(model_dir: str, name: str, batch: int, num: int, threads: int, args) -> dict:
    requests = workload(name, num, args)
    out_tokens = sum(r.output_len for r in requests)
    mean_input = sum(len(r.prompt_token_ids) for r in requests) / num
    print(
        f"\n{name} outputs, batch {batch}: {num} requests, {out_tokens} output tokens, "
        f"mean input {mean_input:.0f}, {threads} thread(s), {args.dtype}"
    )
    measured = run_case(model_dir, requests, batch, args.systems, threads, args)
    case = dict(workload=name, batch_size=batch, num_requests=num, output_tokens=out_tokens, mean_input=mean_input)
    return case | measured | ratios(measured["tokens_per_s"]) | run_ratios(measured["runs"])


def save(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
