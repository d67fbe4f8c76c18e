"""What every experiment of the paper benchmark (:mod:`benchmarks.paper`) shares: the
profiles (model, KV budgets, loads), the :class:`Context` an experiment gets, and how it
saves its results."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
from dataclasses import asdict, dataclass, field

import torch

from benchmarks.model_shapes import LLAMA_7B
from benchmarks.workloads import Request, poisson_arrivals, sample_requests
from pagedllm.kernels.kv_quant import cache_dtype, row_width
from pagedllm.server.config import EngineConfig, choose_token_budget
from pagedllm.server.engine.llm_engine import LLMEngine
from pagedllm.server.worker.dtype_choice import choose_dtype
from pagedllm.server.worker.model_runner import resolve_device

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "paper")


@dataclass(frozen=True)
class Profile:
    """Model, budgets and loads of one scale."""

    name: str
    budget_blocks: dict[str, int]  # workload -> device KV blocks of 16 tokens
    num_requests: dict[str, int]
    rates: dict[str, dict[str, list[float]]]  # clock -> workload -> request rates swept (simulated req/s)
    clocks: tuple[str, ...] = ("measured", "roofline")  # see sim.py
    block_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    block_size: int = 16
    max_model_len: int = 2048
    max_input: int = 1024  # the samplers' clip on prompt and output lengths
    max_output: int = 1024
    block_size_rates: dict[str, float] = field(default_factory=lambda: {"sharegpt": 8, "alpaca": 60})  # fig18
    preemption_budget_tokens: int = 4096  # fig19: a quarter of fig12's, so every run preempts
    hf_baselines: bool = True
    engine: dict = field(default_factory=dict)  # extra engine arguments (dtype, load_format)


CPU = Profile(
    name="cpu",
    # ShareGPT: 16,384 token slots, about what OPT-13B leaves for KV on a 40 GB A100 (the
    # paper's setting: 800 KB per token, ~12 GB). Alpaca's requests are ~7x shorter, so
    # 4,096 slots keep memory, not max_num_seqs, the limit there too.
    budget_blocks={"sharegpt": 1024, "alpaca": 256, "chatbot": 1024, "prefix": 256},
    num_requests={"sharegpt": 100, "alpaca": 200, "chatbot": 80, "prefix": 100},
    rates={
        "measured": {
            "sharegpt": [4, 6, 8, 10, 12, 14, 16, 20, 25, 32],
            "alpaca": [20, 40, 60, 80, 100, 120, 150, 200, 250, 300],
            "chatbot": [2, 3, 4, 6, 8, 10, 13, 16, 20],
        },
        "roofline": {
            "sharegpt": [1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 25, 32, 40],
            "alpaca": [2, 5, 10, 20, 30, 40, 50, 60, 80, 100, 130, 170, 220, 300],
            "chatbot": [0.5, 1, 1.5, 2, 3, 4, 5, 6, 8, 10, 13, 16],
        },
    },
)
GPU = Profile(
    name="gpu",
    budget_blocks={"sharegpt": 1024, "alpaca": 256, "chatbot": 1024, "prefix": 256},
    num_requests={"sharegpt": 400, "alpaca": 800, "chatbot": 300, "prefix": 200},
    rates={
        "measured": {
            "sharegpt": [0.5, 1, 1.5, 2, 3, 4, 5, 6, 8],
            "alpaca": [5, 10, 15, 20, 30, 40, 50, 60],
            "chatbot": [0.25, 0.5, 1, 1.5, 2, 3, 4],
        }
    },
    clocks=("measured",),
    hf_baselines=False,  # transformers would need the 7B weights written out
    engine={"dtype": "bfloat16", "load_format": "dummy", "device": "cuda"},
)


@dataclass
class Context:
    """What every experiment gets: the profile, the model directory, seed and threads."""

    profile: Profile
    model_dir: str
    seed: int
    threads: int
    vocab: int
    clocks: tuple[str, ...] = ("measured",)
    workloads: tuple[str, ...] = ("sharegpt", "alpaca")  # of fig12
    results: str = RESULTS
    """The directory the experiments write their JSON and PNG files to."""
    kv_cache_dtype: str = "auto"
    """Our engine's KV cache format; an 8-bit one gets as many more blocks as the same memory holds."""

    def requests(self, workload: str, num: int | None = None) -> list[Request]:
        n = num or self.profile.num_requests[workload]
        p = self.profile
        return sample_requests(workload, n, self.vocab, seed=self.seed, max_input=p.max_input, max_output=p.max_output)

    def arrivals(self, num: int, rate: float) -> list[float]:
        return poisson_arrivals(num, rate, seed=self.seed).tolist()

    def budget_tokens(self, workload: str) -> int:
        return self.profile.budget_blocks[workload] * self.profile.block_size

    def engine(self, workload: str, engine_cls: type[LLMEngine] = LLMEngine, **overrides) -> LLMEngine:
        """An engine with ``workload``'s KV budget (in tokens, whatever the block size)."""
        return engine_cls(self.engine_config(workload, **overrides))

    def token_budget(self, workload: str) -> int:
        """The per-step token budget the engine resolves on this machine (baselines get the same)."""
        config = self.engine_config(workload)
        device = resolve_device(config.model.device).type
        return choose_token_budget(config.scheduler, device, self.profile.max_model_len).tokens

    def engine_config(self, workload: str, **overrides) -> EngineConfig:
        block_size = overrides.pop("block_size", self.profile.block_size)
        args = dict(
            model=self.model_dir,
            skip_tokenizer_init=True,
            max_model_len=self.profile.max_model_len,
            block_size=block_size,
            num_gpu_blocks_override=int(self.budget_tokens(workload) * self.kv_blocks_per_budget_block()) // block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            enable_prefix_caching=False,
            max_num_seqs=256,
            cpu_threads=self.threads,
            seed=self.seed,
            **self.profile.engine,
        )
        args.update(overrides)
        return EngineConfig.from_kwargs(**args)

    def kv_blocks_per_budget_block(self) -> float:
        """How many of our blocks fit in the memory of one budget block, a block of the cache the
        engine keeps in the model's dtype (the one ``auto`` runs): 1 for ``auto``; for an 8-bit
        cache the ratio of row bytes (2x a 16-bit cache's, 4x float32's, less int8's row scales)."""
        if self.kv_cache_dtype == "auto":
            return 1.0
        with open(os.path.join(self.model_dir, "config.json")) as f:
            hf = json.load(f)
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        model_bytes = head_dim * self.model_dtype(hf).itemsize
        cache = cache_dtype(self.kv_cache_dtype, torch.float32)
        return model_bytes / (row_width(cache, head_dim) * cache.itemsize)

    def model_dtype(self, hf_config: dict) -> torch.dtype:
        """The dtype the engine runs the profile's model in (``auto`` resolved as the engine does)."""
        name = self.profile.engine.get("dtype", "auto")
        if name != "auto":
            return getattr(torch, name)
        return choose_dtype(name, hf_config, resolve_device(self.profile.engine.get("device", "auto"))).dtype

    def memory_bound_requests(self, workload: str) -> int:
        """Requests enough for memory to decide at this cache format: the profile's count grows
        with the blocks an 8-bit cache gets, so the queue outlasts the larger budget as long."""
        return math.ceil(self.profile.num_requests[workload] * self.kv_blocks_per_budget_block())


def build_model(profile: Profile, path: str) -> int:
    """Write the profile's model to ``path``; returns its vocabulary size."""
    if profile.name == "gpu":
        from transformers import LlamaConfig

        LlamaConfig(**LLAMA_7B, bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(path)
        return LLAMA_7B["vocab_size"]
    from pagedllm.server.demo import save_tiny_llama

    save_tiny_llama(path, max_position_embeddings=4096)
    return 256  # byte tokens only: no special ids in prompts


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, cpu"


def save(name: str, ctx: Context, result: dict, figure, variant: str = "") -> str:
    """Write ``<name>-<profile>[-<variant>].json`` and ``.png`` under the results directory."""
    os.makedirs(ctx.results, exist_ok=True)
    kv = "" if ctx.kv_cache_dtype == "auto" else f"kv-{ctx.kv_cache_dtype}"
    stem = os.path.join(ctx.results, "-".join(part for part in (name, ctx.profile.name, variant, kv) if part))
    figure.savefig(stem + ".png", dpi=110, bbox_inches="tight")
    record = {
        "experiment": name,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "threads": ctx.threads,
        "profile": asdict(ctx.profile),
        "kv_cache_dtype": ctx.kv_cache_dtype,
        "command": "python -m benchmarks.paper " + " ".join(sys.argv[1:]),
        **result,
    }
    with open(stem + ".json", "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {stem}.json and .png")
    return stem
