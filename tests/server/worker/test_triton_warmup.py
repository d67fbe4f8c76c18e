"""The start-up warm-up launches every Triton kernel of the CUDA path on the shapes serving
uses (each captured decode batch size, split and unsplit, a prefill chunk) and writes no
cache; on a GPU, serving afterwards compiles nothing more."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from pagedllm.kernels.paged_decode_attention import paged_decode_attention_kernel
from pagedllm.kernels.paged_prefill_attention import paged_prefill_attention_kernel
from pagedllm.server.worker.attention import select_attention_ops
from pagedllm.server.worker.cuda_graphs import capture_sizes
from pagedllm.server.worker.models import decoder, rope
from pagedllm.server.worker.triton_warmup import WarmupShapes, warm_up
from tests.server.worker.test_launch_count import BLOCK_SIZE, _llama

CUDA_PATH_KERNELS = {
    "rms_norm_kernel",
    "rotary_embedding_kernel",
    "reshape_and_cache_kernel",
    "paged_decode_attention_kernel",
    "paged_prefill_attention_kernel",
    "act_and_mul_kernel",
}


def test_decode_steps_cover_every_captured_size_split_and_not_largest_first():
    steps = WarmupShapes(max_rows=40, prefill_tokens=512, max_blocks=64).decode_steps()
    assert steps[0] == (40, 64)
    assert {rows for rows, _ in steps} == set(capture_sizes(40)) == {1, 2, 4, 8, 16, 24, 32, 40}
    assert all((rows, 1) in steps and (rows, 64) in steps for rows in capture_sizes(40))
    assert WarmupShapes(max_rows=1, prefill_tokens=8, max_blocks=1).decode_steps() == [(1, 1)]


def _recording_launches(monkeypatch) -> dict[str, list[dict]]:
    """Kernel name -> the keyword arguments (compile-time constants) of each launch through the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    launches: dict[str, list[dict]] = defaultdict(list)
    run = InterpretedFunction.run

    def recorded(kernel, *args, grid, warmup, **kwargs):
        launches[kernel.__name__].append({"grid": grid, **kwargs})
        return run(kernel, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    return launches


def test_warm_up_launches_every_cuda_path_kernel_on_serving_shapes(monkeypatch):
    for module in (decoder, rope):
        monkeypatch.setattr(module, "runs_on_triton", lambda t: True)
    model = _llama()
    ops = select_attention_ops("triton", torch.device("cpu"))
    copies = []
    # NOTE: the interpreter cannot run the block copy (it loads the caches' addresses from memory)
    monkeypatch.setattr(ops, "copy_blocks", lambda k, v, mapping: copies.append((len(k), len(v), mapping.tolist())))
    _, kv_heads, head_dim = model.kv_shape
    caches = [tuple(torch.randn(6, BLOCK_SIZE, kv_heads, head_dim) for _ in range(2)) for _ in range(2)]
    before = [tuple(t.clone() for t in pair) for pair in caches]
    launches = _recording_launches(monkeypatch)
    shapes = WarmupShapes(max_rows=9, prefill_tokens=40, max_blocks=6)
    assert warm_up(model, caches, ops, shapes, torch.device("cpu")) == len(shapes.decode_steps()) + 1
    assert set(launches) == CUDA_PATH_KERNELS
    decode_rows = {launch["grid"][0] for launch in launches["paged_decode_attention_kernel"]}
    assert decode_rows == set(capture_sizes(9)) == {1, 2, 4, 8, 9}
    rotary_rows = {launch["grid"][0] for launch in launches["rotary_embedding_kernel"]}
    assert rotary_rows == {1, 2, 4, 8, 9, 40}  # every decode size and the prefill chunk
    assert copies == [(2, 2, [[0, 0]])]
    for pair, old in zip(caches, before):  # NOTE: slot -1 everywhere: no cache entry written
        assert all(torch.equal(t, o) for t, o in zip(pair, old))


def test_step_varying_integers_stay_out_of_the_compile_key():
    def unspecialized(kernel) -> set[str]:
        names = getattr(kernel, "do_not_specialize", None) or getattr(kernel, "kwargs", {}).get("do_not_specialize")
        if names and isinstance(next(iter(names)), int):  # NOTE: a compiled JITFunction keeps indices
            names = [kernel.arg_names[i] for i in names]
        return set(names or ())

    assert {"num_splits", "stride_bt_seq", "stride_lse_head"} <= unspecialized(paged_decode_attention_kernel)
    assert {"num_seqs", "stride_bt_seq"} <= unspecialized(paged_prefill_attention_kernel)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_serving_after_start_up_compiles_no_triton_kernel(tiny_llama, enforce_eager):
    import importlib

    from engine_factories import make_prompts

    from pagedllm.server import LLM, SamplingParams

    names = ("copy_blocks", "fused_add_rms_norm", "paged_decode_attention", "paged_prefill_attention",
             "reshape_and_cache", "rotary_embedding", "silu_and_mul")  # fmt: skip
    modules = [importlib.import_module(f"pagedllm.kernels.{name}") for name in names]
    kernels = [obj for m in modules for obj in vars(m).values() if hasattr(obj, "device_caches")]

    def compiled() -> int:
        return sum(len(caches[0]) for k in kernels for caches in k.device_caches.values())

    llm = LLM(model=tiny_llama, block_size=16, device="cuda", dtype="float16", max_num_seqs=20,
              enforce_eager=enforce_eager)  # fmt: skip
    after_start = compiled()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for n, (lo, hi) in ((1, (1, 5)), (3, (17, 40)), (13, (1, 90)), (20, (30, 64))):
        prompts = make_prompts(n, min_len=lo, max_len=hi, seed=n)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert compiled() == after_start, "a Triton kernel compiled while serving"
    llm.shutdown()


def test_a_cuda_runner_warms_up_before_capturing_and_a_cpu_one_never(tiny_llama, monkeypatch):
    from pagedllm.server import LLM
    from pagedllm.server.worker import model_runner
    from pagedllm.server.worker.attention import TritonAttention

    calls = []
    monkeypatch.setattr(model_runner, "warm_up", lambda *args: calls.append(("warm_up", args[3])))
    monkeypatch.setattr(model_runner, "try_capture", lambda *args: calls.append(("capture", args[3])))
    llm = LLM(model=tiny_llama, block_size=16, max_num_seqs=12, max_model_len=100, max_num_batched_tokens=64)
    assert calls == []  # NOTE: the CPU runner just built its cache
    runner = llm.llm_engine.runner
    # the CUDA path's choices, on the CPU: what allocate_cache does with them
    monkeypatch.setattr(runner, "device", torch.device("cuda"))
    monkeypatch.setattr(runner, "ops", TritonAttention())
    monkeypatch.setattr(runner, "allocate_local_cache", lambda *args: None)
    runner.allocate_cache(8, 0)
    assert calls == [("warm_up", WarmupShapes(max_rows=12, prefill_tokens=64, max_blocks=7)), ("capture", 12)]
    llm.shutdown()
