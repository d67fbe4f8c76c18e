"""Hugging Face ``transformers`` baselines for the offline benchmarks, on the same requests.

- ``run_hf_static``: ``generate`` in static batches of ``batch_size`` (left-padded); a batch
  runs until its longest request ends, as the paper's baseline does.
- ``run_hf_continuous``: ``transformers``' own continuous batching with a paged cache
  (``model.generate_batch``), at most ``batch_size`` requests in flight.
- ``forward_ceiling``: tokens/s of one batch-B forward of single tokens with no KV context,
  i.e. what the weights alone allow a decode step to reach.

Each returns seconds (or tokens/s for the ceiling); every run loads the model afresh, in
``dtype`` (float32 unless given), onto the GPU where there is one.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Protocol

import torch
from tqdm import tqdm

PAD_ID = 2
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Request(Protocol):
    """What the baselines read from a request (``workloads.Request`` has both fields)."""

    prompt_token_ids: list[int]
    output_len: int


def _load(model_dir: str, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn_implementation)
    return model.to(DEVICE).eval()


def _left_padded(batch: Sequence[Request]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = [[PAD_ID] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch]
    mask = [[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch]
    return torch.tensor(ids, device=DEVICE), torch.tensor(mask, device=DEVICE)  # [batch, width] each


@torch.inference_mode()
def run_hf_static(
    model_dir: str, requests: Sequence[Request], batch_size: int, dtype: torch.dtype = torch.float32
) -> float:
    """Seconds for greedy ``generate`` over ``requests`` in static batches of ``batch_size``."""
    model = _load(model_dir, dtype=dtype)
    start = time.perf_counter()
    for i in tqdm(range(0, len(requests), batch_size), desc=f"hf static bs{batch_size}"):
        batch = requests[i : i + batch_size]
        ids, mask = _left_padded(batch)
        new = max(r.output_len for r in batch)  # a static batch runs until its longest request ends
        model.generate(
            ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=PAD_ID
        )
    _sync()
    return time.perf_counter() - start


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def run_hf_continuous(
    model_dir: str,
    requests: Sequence[Request],
    batch_size: int,
    max_cache_tokens: int | None = None,
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
) -> float:
    """Seconds for greedy continuous batching in ``transformers`` (paged cache) over ``requests``.

    Uses the manager behind ``model.generate_batch`` so that every request keeps its own
    output length; at most ``batch_size`` requests are in flight. ``max_cache_tokens`` sizes
    the paged cache; by default it holds ``batch_size`` of the longest requests.
    """
    from transformers import ContinuousBatchingConfig

    model = _load(model_dir, attn_implementation, dtype)
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    page = 256
    tokens = max_cache_tokens or batch_size * longest
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    options = dict(
        num_blocks=-(-tokens // page) + batch_size,
        max_requests_per_batch=batch_size,
        max_batch_tokens=max(2048, batch_size),
        use_cuda_graph=False,
    )
    # NOTE: transformers renamed block_size to page_size (5.2x) and added auto_switch_to_flash
    options["page_size" if "page_size" in fields else "block_size"] = page
    if "auto_switch_to_flash" in fields:
        options["auto_switch_to_flash"] = False
    cb = ContinuousBatchingConfig(**options)
    return serve_continuous(model, requests, cb, f"hf continuous bs{batch_size}")


def serve_continuous(model, requests: Sequence[Request], cb, desc: str) -> float:
    """Seconds ``transformers``' continuous batching (config ``cb``) takes to serve every request queued at once."""
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=PAD_ID)  # no EOS: fixed lengths
    start = time.perf_counter()
    with model.continuous_batching_context_manager(gen, continuous_batching_config=cb, warmup=False) as manager:
        for i, r in enumerate(requests):
            manager.add_request(r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.output_len)
        _collect(manager, requests, desc)
    return time.perf_counter() - start


def _collect(manager, requests: Sequence[Request], desc: str) -> None:
    expected = {f"r{i}": r.output_len for i, r in enumerate(requests)}
    with tqdm(total=len(requests), desc=desc) as bar:
        while expected:
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped early")
                continue
            if result.is_finished():
                if result.error is not None or len(result.generated_tokens) != expected[result.request_id]:
                    raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                del expected[result.request_id]
                bar.update(1)


@torch.inference_mode()
def forward_ceiling(model_dir: str, batch_size: int, repeats: int = 20, dtype: torch.dtype = torch.float32) -> float:
    """Tokens/s of one forward of ``batch_size`` single tokens with no KV context (median of repeats)."""
    model = _load(model_dir, dtype=dtype)
    ids = torch.full((batch_size, 1), 5, device=DEVICE)  # [batch, 1]
    model(ids, use_cache=False)  # warm-up
    times = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        model(ids, use_cache=False)
        _sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return batch_size / times[len(times) // 2]
