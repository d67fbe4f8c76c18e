"""Offline generation with vLLM, run by vLLM's own interpreter: a JSON job in, a JSON result out.

vLLM is never a dependency of PagedLLM: it lives in a venv of its own, so this module
imports nothing of ours and nothing outside the standard library at module level (vLLM is
imported inside :func:`run`). ``benchmarks.throughput --vllm-python PATH`` writes a job,
runs ``PATH -P benchmarks/vllm_runner.py JOB RESULT`` and reads the result back.

Job (``Job.from_json``)::

    {"model": "/dir/with/config.json+safetensors", "dtype": "float32",
     "max_num_seqs": 16, "max_model_len": 2048, "threads": 2, "kv_cache_gib": 4,
     "profile_dir": "",                    # optional: where vLLM's profiler writes its table
     "requests": [{"prompt_token_ids": [5, 17, ...], "output_len": 128}, ...]}

Result (``Result.to_json``)::

    {"elapsed_s": 12.3, "output_tokens": 4096, "tokens_per_s": 333.0,
     "token_ids": [[...], ...],            # greedy outputs, in request order
     "vllm_version": "0.32.0", "engine": {...},   # the engine settings vLLM resolved
     "cpu_s": 24.1}                        # CPU time of all its processes while generating

Every request is greedy (temperature 0) with ``ignore_eos`` and exactly ``output_len``
tokens, as our engine runs them, so the two generate the same number of tokens and, in
float32, the same tokens. Only ``LLM.generate`` is timed (model load, compile and warm-up
are vLLM's start-up, as our engine's are ours).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Job:
    """What to run: one model, one batch size, one list of requests."""

    model: str
    """Directory holding config.json and the safetensors weights (no tokenizer needed)."""
    requests: list[tuple[list[int], int]]
    """(prompt token ids, output tokens) per request."""
    dtype: str = "float32"
    """Weight and activation dtype, one of ``DTYPES``."""
    max_num_seqs: int = 16
    """Most sequences in one step: the batch size."""
    max_model_len: int = 2048
    """Longest prompt + output."""
    threads: int = 1
    """OpenMP threads of vLLM's CPU worker, bound to cores 0..threads-1."""
    kv_cache_gib: float = 4.0
    """KV cache size (``VLLM_CPU_KVCACHE_SPACE``)."""
    profile_dir: str = ""
    """If set (an absolute path): vLLM's torch profiler records ``PROFILE_STEPS`` steps of the
    worker after the first ``PROFILE_STEPS`` of the run and writes its operator table there as
    ``*.profiler_out.txt`` (the run is slower for it: a profile, not a throughput number)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported: choose one of {DTYPES}")
        for name in ("max_num_seqs", "max_model_len", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is out of range: must be >= 1")
        if not self.requests:
            raise ValueError("requests=[] is empty: a job needs at least one request")
        for i, (prompt, output_len) in enumerate(self.requests):
            if not prompt or output_len < 1:
                raise ValueError(
                    f"requests[{i}] has {len(prompt)} prompt and {output_len} output tokens: both must be >= 1"
                )

    def to_json(self) -> str:
        body = asdict(self)
        body["requests"] = [{"prompt_token_ids": p, "output_len": n} for p, n in self.requests]
        return json.dumps(body)

    @classmethod
    def from_json(cls, text: str) -> Job:
        body = json.loads(text)
        body["requests"] = [(list(r["prompt_token_ids"]), int(r["output_len"])) for r in body["requests"]]
        return cls(**body)


def cpu_env(threads: int, kv_cache_gib: float) -> dict[str, str]:
    """vLLM's CPU settings: KV cache size in GiB and OpenMP threads bound to cores 0..threads-1."""
    cores = "0" if threads == 1 else f"0-{threads - 1}"
    return {"VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}", "VLLM_CPU_OMP_THREADS_BIND": cores}


@dataclass(frozen=True)
class Result:
    """What a job measured."""

    elapsed_s: float
    output_tokens: int
    token_ids: list[list[int]]
    vllm_version: str = ""
    engine: dict = field(default_factory=dict)
    cpu_s: float | None = None
    """CPU seconds of vLLM's processes (front end, engine core, worker) while it generated."""

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"tokens_per_s": self.tokens_per_s})

    @classmethod
    def from_json(cls, text: str) -> Result:
        body = json.loads(text)
        body.pop("tokens_per_s", None)  # NOTE: derived, recomputed from elapsed_s and output_tokens
        return cls(**body)


def run(job: Job) -> Result:
    """Generate every request of ``job`` with vLLM's offline ``LLM`` (in this interpreter)."""
    # NOTE: before vLLM is imported; its engine and worker processes inherit the environment
    os.environ.update(cpu_env(job.threads, job.kv_cache_gib))
    from importlib.metadata import version

    from vllm import LLM, SamplingParams

    profiling = {"profiler_config": _profiler_config(job.profile_dir)} if job.profile_dir else {}
    llm = LLM(
        model=job.model,
        skip_tokenizer_init=True,
        dtype=job.dtype,
        max_num_seqs=job.max_num_seqs,
        max_model_len=job.max_model_len,
        seed=0,
        **profiling,
    )
    prompts = [{"prompt_token_ids": prompt} for prompt, _ in job.requests]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for _, n in job.requests]
    if profiling:
        llm.start_profile()
    start, cpu = time.perf_counter(), _cpu_seconds()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed, cpu_after = time.perf_counter() - start, _cpu_seconds()
    if profiling:
        llm.stop_profile()
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    expected = [n for _, n in job.requests]
    if [len(t) for t in token_ids] != expected:
        raise RuntimeError("vLLM generated other lengths than asked for (ignore_eos and max_tokens not honoured)")
    cpu_s = cpu_after - cpu if cpu is not None and cpu_after is not None else None
    return Result(elapsed, sum(expected), token_ids, version("vllm-cpu"), _engine_settings(llm), cpu_s)


PROFILE_STEPS = 20


def _profiler_config(directory: str) -> dict:
    return {
        "profiler": "torch",
        "torch_profiler_dir": directory,
        "torch_profiler_with_stack": False,
        "delay_iterations": PROFILE_STEPS,  # NOTE: past the first prefills, into steady decoding
        "max_iterations": PROFILE_STEPS,
        "ignore_frontend": True,
    }


def _cpu_seconds() -> float | None:
    """User + system CPU seconds of this process and its descendants so far (psutil comes with vLLM)."""
    try:
        import psutil
    except ImportError:
        return None
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def _engine_settings(llm) -> dict:
    """The scheduler settings vLLM chose (its defaults differ from ours), for the record."""
    config = llm.llm_engine.vllm_config.scheduler_config
    return {
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "chunked_prefill": bool(getattr(config, "enable_chunked_prefill", False)),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -P vllm_runner.py JOB.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = Job.from_json(f.read())
    result = run(job)
    with open(argv[1], "w") as f:
        f.write(result.to_json())
    return 0


if __name__ == "__main__":  # NOTE: vLLM's engine process may re-import this file; only the parent runs a job
    sys.exit(main(sys.argv[1:]))
