"""Decode-step time of our engine on a GPU, a LLaMA shape in bf16 (LLaMA-7B by default, dummy
weights), at several batch sizes, against the hardware's floor for the same step.

Per batch size B:
  ms_per_decode_step  wall time of N engine steps once all B prompts are in (decode-only
                      steps, each waiting for its sampled ids) / N
  floor_ms            (weight bytes + KV bytes the step reads) / measured copy bandwidth
                      (read + write counted, as benchmarks.kernels does)
  gpu_busy_fraction   sum of the GPU kernels' time / wall time, under torch.profiler, over
                      a few decode steps: far under 1 means the host (Python, launches,
                      syncs) is the limit, not the GPU
and the top operators by GPU time and by host time, from the same profile.

    python -m benchmarks.gpu_step_profile --batch-sizes 1,16,64,256 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

import torch

from benchmarks.common import HelpFormatter
from benchmarks.model_shapes import SHAPES


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy, read plus write."""
    from triton.testing import do_bench

    n = 1 << 30
    a = torch.randn(n // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=25, rep=100, return_mode="median")
    return 2 * n / (ms / 1e3)


def weight_bytes(shape: str = "llama-7b") -> int:
    """Bytes of a LLaMA of ``shape``'s bf16 weights (untied embedding and LM head)."""
    f = SHAPES[shape]
    h, i, v, n = (f[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers"))
    kv = h * f.get("num_key_value_heads", f["num_attention_heads"]) // f["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return 2 * (n * per_layer + 2 * v * h + h)


def kv_bytes(batch: int, context: int, shape: str = "llama-7b") -> int:
    """Bytes of bf16 K and V that ``batch`` sequences of ``context`` tokens hold."""
    f = SHAPES[shape]
    kv = f["hidden_size"] * f.get("num_key_value_heads", f["num_attention_heads"]) // f["num_attention_heads"]
    return 2 * 2 * f["num_hidden_layers"] * kv * batch * context


def timed_generate(llm, batch: int, prompt_len: int, out_len: int) -> float:
    from pagedllm.server import SamplingParams

    prompts = [{"prompt_token_ids": [3 + (j * 7 + b) % 30000 for j in range(prompt_len)]} for b in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    assert all(len(o.outputs[0].token_ids) == out_len for o in outs)
    return time.perf_counter() - start


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_steps(llm, batch: int, prompt_len: int, steps: int, profiled: int, top: int = 8) -> dict:
    """Time ``steps`` engine steps once all ``batch`` prompts are in (decode-only steps), then
    ``profiled`` more under torch.profiler: GPU kernel time over wall time, and the ``top``
    operators by GPU and by host time. The requests are aborted after, so their blocks are free again.

    NOTE: timed step by step: subtracting a 1-token generate from an N-token one gave negative
    step times at batch 64 and 256 (the prompts' chunks interleave differently in the two)."""
    from torch.profiler import ProfilerActivity, profile

    from pagedllm.server import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=steps + profiled + 4, ignore_eos=True)
    ids = [f"d{batch}-{b}" for b in range(batch)]
    for b, rid in enumerate(ids):
        engine.add_request(rid, {"prompt_token_ids": [3 + (j * 7 + b) % 30000 for j in range(prompt_len)]}, params)
    started: set[str] = set()
    while len(started) < batch:  # the prompts' steps, some mixed with the first decodes
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    engine.step()
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()  # NOTE: returns the sampled ids on the host: each step waits for the device
    step_s = (time.perf_counter() - start) / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(profiled):
            engine.step()
        _sync()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    by_gpu = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    by_cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    engine.abort_request(ids)
    return {
        "step_ms": round(step_s * 1e3, 3),
        "gpu_busy": round(sum(e.self_device_time_total for e in events) / 1e6 / wall, 3),
        "top_gpu_ms": [(e.key, round(e.self_device_time_total / 1e3, 2), e.count) for e in by_gpu],
        "top_host_ms": [(e.key, round(e.self_cpu_time_total / 1e3, 2), e.count) for e in by_cpu],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_step_profile", description=__doc__, formatter_class=HelpFormatter
    )
    p.add_argument("--shape", default="llama-7b", choices=("llama-7b", "llama-3-8b"), help="model shape (LLaMA)")
    p.add_argument("--batch-sizes", default="1,16,64,256", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--decode-steps", type=int, default=64, help="decode steps timed per batch size")
    p.add_argument("--profile-steps", type=int, default=8, help="steps under torch.profiler per batch size")
    p.add_argument("--top", type=int, default=12, help="operators listed per table")
    p.add_argument("--engine-args", default="{}", help="extra LLM(...) arguments as JSON")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"), help="results directory")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks.gpu_step_profile needs a CUDA device")
    from benchmarks.llama7b import write_llama7b
    from pagedllm.server import LLM

    bw = copy_bandwidth()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    result: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name(0),
        "shape": args.shape,
        "torch": torch.__version__,
        "copy_bandwidth_gbs": bw / 1e9,
        "command": "python -m benchmarks.gpu_step_profile " + " ".join(sys.argv[1:]),
        "cases": [],
    }
    with tempfile.TemporaryDirectory() as model_dir:
        write_llama7b(model_dir, shape=args.shape)
        engine_args = dict(load_format="dummy", dtype="bfloat16", max_num_seqs=max(batches), skip_tokenizer_init=True)
        llm = LLM(model=model_dir, **(engine_args | json.loads(args.engine_args)))
        timed_generate(llm, 2, 16, 4)  # warm-up: compiles the kernels
        for batch in batches:
            context = args.prompt_len + args.decode_steps
            floor_ms = (weight_bytes(args.shape) + kv_bytes(batch, context, args.shape)) / bw * 1e3
            stats = decode_steps(llm, batch, args.prompt_len, args.decode_steps, args.profile_steps, args.top)
            case = {
                "batch": batch,
                "ms_per_decode_step": stats["step_ms"],
                "tokens_per_s": batch / stats["step_ms"] * 1e3,
                "floor_ms": floor_ms,
                "floor_over_measured": floor_ms / stats["step_ms"],
                "gpu_busy_fraction": stats["gpu_busy"],
                "top_gpu_ms": stats["top_gpu_ms"],
                "top_host_ms": stats["top_host_ms"],
            }
            result["cases"].append(case)
            print(
                f"batch {batch:4d}: {case['ms_per_decode_step']:7.2f} ms/step ({case['tokens_per_s']:8.0f} tok/s), "
                f"floor {floor_ms:6.2f} ms ({case['floor_over_measured']:.2f} of it), "
                f"GPU busy {case['gpu_busy_fraction']:.2f} while profiled"
            )
            for name, ms, count in case["top_gpu_ms"][:6]:
                print(f"    gpu  {ms:9.2f} ms  x{count:<6d} {name[:90]}")
            for name, ms, count in case["top_host_ms"][:6]:
                print(f"    host {ms:9.2f} ms  x{count:<6d} {name[:90]}")
        llm.shutdown()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"gpu-step-profile-{datetime.date.today().isoformat()}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
