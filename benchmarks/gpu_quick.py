"""The GPU summary in one short run: a LLaMA-3-8B-shaped model (dummy bf16 weights) on one GPU.

Each section runs in its own process (``scripts/gpu-validate.sh quick`` gives each a time limit)
and writes ``quick-SECTION.json`` into ``--out``; ``summary`` merges whatever the others wrote
into ``summary-DATE-DEVICE.json`` and ``.md``:

    env      device, driver, torch, triton; device-to-device copy bandwidth and bf16 GEMM rate
    engine   start-up time; GPU kernels per decoder layer (an eager prompt step); decode step time
             against the floor (weights + KV bytes over the copy bandwidth) and GPU busy at
             batch 1, 16, 64, 256; offline output tok/s on 1,000 ShareGPT-like prompts with
             ``max_num_seqs`` 256 (stopped at ``--offline-deadline-s``: the tokens made by
             then over the time taken, with how many requests finished)
    serve    ``pagedllm serve --max-num-seqs 256`` and ``benchmarks.serve`` at rates 4, 16, inf:
             output tok/s, P50 TPOT, P99 ITL, P99 TTFT
    kernels  paged decode against contiguous SDPA at batch 1 and 8 (GQA 32/8, head 128), timed by
             CUDA-graph replays (``_do_bench`` keys: by do_bench, host launch included)
    tests    ``pytest -m gpu`` of the kernels, launch count and warm-up tests: pass count

    python -m benchmarks.gpu_quick env --out gpu-out/res
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

SHAPE = "llama-3-8b"
MODEL_DIR = "/tmp/llama-3-8b"
BATCHES = (1, 16, 64, 256)


def _save(out: Path, section: str, data: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"quick-{section}.json").write_text(json.dumps(data, indent=2))
    print(f"[{section}] wrote {out / f'quick-{section}.json'}")


def _model_dir() -> str:
    from benchmarks.llama7b import write_llama7b

    if not os.path.exists(os.path.join(MODEL_DIR, "config.json")):
        write_llama7b(MODEL_DIR, shape=SHAPE)
    return MODEL_DIR


# -- sections ---------------------------------------------------------------------------------
def env(args) -> dict:
    import torch
    import triton
    from triton.testing import do_bench

    from benchmarks.gpu_step_profile import copy_bandwidth

    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    y = torch.randn_like(x)
    ms = do_bench(lambda: x @ y, warmup=50, rep=200, return_mode="median")
    return {
        "device": torch.cuda.get_device_name(0),
        "nvidia_smi": smi,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "copy_gbs": round(copy_bandwidth() / 1e9, 1),
        "bf16_gemm_tflops": round(2 * 8192**3 / ms / 1e9, 1),
    }


def _kernels_per_layer(llm, layers: int) -> dict:
    """GPU kernels of one eager prompt step (64 tokens, one sampled) over the layer count."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu_step_profile import timed_generate

    timed_generate(llm, 1, 64, 1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed_generate(llm, 1, 64, 1)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"kernels_in_step": len(kernels), "launches_per_layer": round(len(kernels) / layers, 1)}


def _step_profile(llm, bw: float, prompt_len: int = 512, steps: int = 32) -> list[dict]:
    from benchmarks.gpu_step_profile import decode_steps, kv_bytes, weight_bytes

    cases = []
    for batch in BATCHES:
        case = {"batch": batch} | decode_steps(llm, batch, prompt_len, steps, 8)
        case["floor_ms"] = round((weight_bytes(SHAPE) + kv_bytes(batch, prompt_len + steps, SHAPE)) / bw * 1e3, 3)
        case["floor_over_step"] = round(case["floor_ms"] / case["step_ms"], 3)
        print(f"[engine] batch {batch}: {case['step_ms']} ms/step, floor {case['floor_ms']}, busy {case['gpu_busy']}")
        cases.append(case)
    return cases


def _offline(llm, num: int, deadline_s: float, vocab: int) -> dict:
    """``num`` ShareGPT-like requests through the engine's steps, each asking for its last output
    only as ``LLM.generate`` does; stopped at ``deadline_s``, the tokens of requests still running
    are counted from the engine's sequences before they are aborted."""
    from tqdm import tqdm

    from benchmarks.workloads import sample_requests
    from pagedllm.server import RequestOutputKind, SamplingParams

    engine = llm.llm_engine
    reqs = sample_requests("sharegpt", num, vocab - 10, seed=0)
    for i, r in enumerate(reqs):
        ids = [3 + t for t in r.prompt_token_ids]
        params = SamplingParams(
            temperature=0, max_tokens=r.output_len, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
        )
        engine.add_request(f"q{i}", {"prompt_token_ids": ids}, params)
    made: dict[str, int] = {}
    finished = 0
    start = time.perf_counter()
    with tqdm(total=sum(r.output_len for r in reqs), desc="offline", mininterval=5) as bar:
        while engine.has_unfinished_requests() and time.perf_counter() - start < deadline_s:
            for out in engine.step():
                made[out.request_id] = len(out.outputs[0].token_ids)
                bar.update(made[out.request_id])
                finished += out.finished
    wall = time.perf_counter() - start
    left = [f"q{i}" for i in range(num) if f"q{i}" not in made]
    for request_id in left:
        state = engine._requests.get(request_id)
        if state is not None:
            made[request_id] = len(state.group.seqs[0].output_token_ids)
    engine.abort_request(left)
    return {
        "requests": num,
        "finished": finished,
        "output_tokens": sum(made.values()),
        "wall_s": round(wall, 2),
        "offline_out_tok_s": round(sum(made.values()) / wall, 1),
        "stopped_at_deadline": finished < num,
    }


def engine(args) -> dict:
    import torch

    from benchmarks.gpu_step_profile import copy_bandwidth
    from benchmarks.model_shapes import SHAPES
    from pagedllm.server import LLM

    bw = copy_bandwidth()
    model = _model_dir()
    start = time.perf_counter()
    llm = LLM(model=model, load_format="dummy", dtype="bfloat16", max_num_seqs=256, skip_tokenizer_init=True)
    result: dict = {"startup_s": round(time.perf_counter() - start, 1), "copy_gbs": round(bw / 1e9, 1)}
    print(f"[engine] start-up {result['startup_s']} s")
    _save(args.out, "engine", result)
    result |= _kernels_per_layer(llm, SHAPES[SHAPE]["num_hidden_layers"])
    _save(args.out, "engine", result)
    result["steps"] = _step_profile(llm, bw)
    _save(args.out, "engine", result)
    if args.offline_prompts:
        result["offline"] = _offline(llm, args.offline_prompts, args.offline_deadline_s, SHAPES[SHAPE]["vocab_size"])
    result["gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    llm.shutdown()
    return result


def serve(args) -> dict:
    model = _model_dir()
    port = 8011
    log = open(args.out / "serve-server.log", "w")
    cmd = [sys.executable, "-m", "pagedllm.server.entrypoints.cli", "serve", "--model", model, "--load-format",
           "dummy", "--dtype", "bfloat16", "--max-num-seqs", "256", "--port", str(port),
           "--served-model-name", SHAPE]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    result: dict = {"command": " ".join(cmd[2:]), "runs": {}}
    try:
        import httpx

        while proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        if proc.poll() is not None:
            result["error"] = f"the server exited with {proc.returncode} before it was ready"
            return result
        result["startup_s"] = round(time.perf_counter() - start, 1)
        print(f"[serve] ready in {result['startup_s']} s")
        for run in args.serve_runs.split(","):
            rate, prompts = run.split(":")
            name = f"quick-serve-rate{rate}"
            argv = ["--base-url", f"http://127.0.0.1:{port}", "--dataset", "sharegpt", "--num-prompts",
                    str(prompts), "--request-rate", rate, "--max-concurrency", "256", "--disable-tqdm",
                    "--result-name", name]  # fmt: skip
            try:
                subprocess.run([sys.executable, "-m", "benchmarks.serve", *argv], timeout=args.serve_run_timeout_s)
            except subprocess.TimeoutExpired:
                result["runs"][rate] = {"prompts": prompts, "error": f"not done in {args.serve_run_timeout_s} s"}
                continue
            summary = json.loads((Path("benchmarks/results") / f"{name}.json").read_text())["summary"]
            result["runs"][rate] = {
                "prompts": prompts,
                "completed": summary["completed"],
                "out_tok_s": round(summary["output_throughput"], 1),
                "p50_tpot_ms": round(summary["median_tpot_ms"], 2),
                "p99_itl_ms": round(summary["p99_itl_ms"], 2),
                "p99_ttft_ms": round(summary["p99_ttft_ms"], 1),
            }
            print(f"[serve] rate {rate}: {result['runs'][rate]}")
            _save(args.out, "serve", result)
    finally:
        proc.terminate()
        proc.wait(30)
    return result


def kernels(args) -> dict:
    """Paged decode against SDPA, each timed by CUDA-graph replays (the kernels alone, as a graphed
    decode step runs them) and by do_bench (each call's host-side launch inside its event window)."""
    import torch

    from benchmarks.gpu_step_profile import copy_bandwidth
    from benchmarks.kernels import Config, bench_config, timer

    bw = copy_bandwidth()
    rows = []
    for kind in ("cudagraph", "do_bench"):
        bench = timer(kind, 100)
        for batch in (1, 8):
            for ctx in (512, 2048, 8192):
                row = bench_config(Config(batch, ctx, 32, 8, 128, 16), torch.bfloat16, bench, bw, 0.8)
                print(f"[kernels] {kind}: {row}")
                rows.append(row | {"timer": kind})
    return {"decode_vs_sdpa": rows}


def tests(args) -> dict:
    xml = args.out / "gpu-tests.xml"
    worker = "tests/server/worker/"
    names = ("test_launch_count.py", "test_triton_warmup.py", "test_cuda_graphs.py", "test_decoder_triton_ops.py",
             "quantization/test_quant_cuda_kernels.py")  # fmt: skip
    files = ["tests/kernels"] + [worker + f for f in names]
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", *files, "-q", "-p", "no:cacheprovider", "-rfE", "-n", "8",
           "--timeout", "200", "--junitxml", str(xml)]  # fmt: skip
    rc = subprocess.run(cmd).returncode
    text = xml.read_text() if xml.exists() else ""
    counts = {k: int(v) for k, v in re.findall(r'\b(tests|failures|errors|skipped)="(\d+)"', text)[:4]}
    passed = counts.get("tests", 0) - sum(counts.get(k, 0) for k in ("failures", "errors", "skipped"))
    return {"returncode": rc, "kernel_tests_passed": passed, "counts": counts}


SECTIONS = {"env": env, "engine": engine, "serve": serve, "kernels": kernels, "tests": tests}


# -- the summary ------------------------------------------------------------------------------
def summarize(out: Path) -> dict:
    """The issue-facing summary from whatever sections wrote (a missing section: null fields)."""
    got = {s: json.loads(p.read_text()) for s in SECTIONS if (p := out / f"quick-{s}.json").exists()}
    env_, eng, srv, ker, tst = (got.get(s, {}) for s in SECTIONS)
    steps = {str(c["batch"]): c for c in eng.get("steps", [])}
    sdpa = {
        f"b{r['batch']}_ctx{r['context_len']}" + ("" if r.get("timer") == "cudagraph" else "_do_bench"): r.get(
            "ratio_vs_sdpa"
        )
        for r in ker.get("decode_vs_sdpa", [])
    }
    return {
        "device": env_.get("device"),
        "date": datetime.date.today().isoformat(),
        "shape": SHAPE,
        "env": env_,
        "copy_gbs": env_.get("copy_gbs", eng.get("copy_gbs")),
        "startup_s": {"engine": eng.get("startup_s"), "server": srv.get("startup_s")},
        "step_ms": {b: c["step_ms"] for b, c in steps.items()},
        "floor_ms": {b: c["floor_ms"] for b, c in steps.items()},
        "floor_over_step": {b: c["floor_over_step"] for b, c in steps.items()},
        "gpu_busy": {b: c["gpu_busy"] for b, c in steps.items()},
        "launches_per_layer": eng.get("launches_per_layer"),
        "decode_vs_sdpa": sdpa,
        "offline_out_tok_s": eng.get("offline", {}).get("offline_out_tok_s"),
        "offline": eng.get("offline"),
        "serve": srv.get("runs"),
        "kernel_tests_passed": tst.get("kernel_tests_passed"),
        "kernel_tests": tst.get("counts"),
        "sections_missing": [s for s in SECTIONS if s not in got],
    }


def markdown(summary: dict) -> str:
    lines = [f"# GPU summary: {summary['device']}, {summary['date']}, {summary['shape']} (dummy bf16)", ""]
    lines += [f"- {k}: {summary[k]}" for k in ("copy_gbs", "startup_s", "launches_per_layer", "offline_out_tok_s")]
    lines += [f"- kernel tests passed: {summary['kernel_tests_passed']} ({summary['kernel_tests']})"]
    lines += [
        f"- sections missing: {summary['sections_missing']}",
        "",
        "| batch | step ms | floor ms | floor / step | GPU busy |",
    ]
    lines.append("|---|---|---|---|---|")
    for b in summary["step_ms"]:
        cells = (summary[k][b] for k in ("step_ms", "floor_ms", "floor_over_step", "gpu_busy"))
        lines.append(f"| {b} | " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "| rate | out tok/s | P50 TPOT ms | P99 ITL ms | P99 TTFT ms |", "|---|---|---|---|---|"]
    for rate, r in (summary["serve"] or {}).items():
        if "error" in r:
            lines.append(f"| {rate} | {r['error']} | | | |")
            continue
        lines.append(f"| {rate} | {r['out_tok_s']} | {r['p50_tpot_ms']} | {r['p99_itl_ms']} | {r['p99_ttft_ms']} |")
    lines += ["", "paged decode / contiguous SDPA: " + json.dumps(summary["decode_vs_sdpa"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from benchmarks.common import HelpFormatter

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_quick", description=__doc__, formatter_class=HelpFormatter
    )
    p.add_argument("section", choices=[*SECTIONS, "summary"], help="what to run")
    p.add_argument("--out", type=Path, default=Path("gpu-out/res"), help="where the section files go")
    p.add_argument("--offline-prompts", type=int, default=1000, help="ShareGPT-like prompts offline (0: none)")
    p.add_argument("--offline-deadline-s", type=float, default=60.0, help="stop the offline run after this long")
    p.add_argument("--serve-runs", default="4:40,16:100,inf:150", help="served runs, RATE:PROMPTS each")
    p.add_argument("--serve-run-timeout-s", type=float, default=45.0, help="limit of each served rate's run")
    args = p.parse_args(argv)
    # NOTE: a time limit's SIGTERM unwinds like Ctrl-C, so a launched server is stopped too
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.section == "summary":
        summary = summarize(args.out)
        slug = re.sub(r"[^A-Za-z0-9]+", "-", summary["device"] or "unknown").strip("-").lower()
        stem = args.out / f"summary-{summary['date']}-{slug}"
        stem.with_suffix(".json").write_text(json.dumps(summary, indent=2))
        stem.with_suffix(".md").write_text(markdown(summary))
        print(markdown(summary))
        return
    _save(args.out, args.section, SECTIONS[args.section](args))


if __name__ == "__main__":
    main()
