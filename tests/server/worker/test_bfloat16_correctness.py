"""The engine in bfloat16 on CPU against transformers in bfloat16 on the same weights.

NOTE: the near-tie tolerance is 0.5 nats, not float32's 1e-3. bfloat16 keeps 8 significant
bits: a logit of 8 is rounded to a multiple of 1/16, and every matmul rounds its output
again. On these tiny checkpoints transformers' own bfloat16 logprobs differ from its
float32 ones by up to 0.3 nats, and its bfloat16 greedy decoding (KV cache, one token per
step) disagrees with its own bfloat16 full forward pass by up to 0.45 nats. Two bfloat16
implementations that order their sums differently may part at any gap of that size; a
wrong kernel gives gaps of nats. So that many near-ties cannot hide a systematic error,
at most a third of the sequences may part from the reference at all.
"""

from __future__ import annotations

import logging

import pytest
import torch
from engine_factories import TINY_SHAPES, HFReference, assert_greedy_matches, make_prompts
from family_factories import WINDOW, save_tiny_family

from pagedllm.kernels import bf16_gemm_cpu, decode_scores_cpu, prefill_attention_cpu
from pagedllm.server import LLM, SamplingParams
from pagedllm.server.demo import save_tiny_llama
from pagedllm.server.worker import cpu_attention, dtype_choice

BF16_TOLERANCE = 0.5
MAX_TOKENS = 12
FAMILIES = ("gemma2", "qwen3")  # soft-capping and alternating windows; q/k norms and qkv bias


@pytest.fixture(scope="module")
def llama_references(tiny_llama_dirs):
    return {name: HFReference(path, dtype=torch.bfloat16) for name, path in tiny_llama_dirs.items()}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16-families")
    return {name: save_tiny_family(str(root / name), name, seed=3) for name in FAMILIES}


def run_bf16_greedy(model_dir, prompts, backend, **engine_args):
    llm = LLM(model=model_dir, dtype="bfloat16", attention_backend=backend, cpu_threads=1, **engine_args)
    assert llm.llm_engine.runner.ops.name == backend
    assert llm.llm_engine.runner.dtype == torch.bfloat16
    assert {c.dtype for kv in llm.llm_engine.runner.kv_caches for c in kv} == {torch.bfloat16}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    return [out.outputs[0].token_ids for out in outputs]


def check_bf16(ref, prompts, ours):
    expected = [ref.greedy(p, MAX_TOKENS) for p in prompts]
    for prompt, got, want in zip(prompts, ours, expected):
        assert_greedy_matches(ref, prompt, got, want, tol=BF16_TOLERANCE)
    parted = sum(got != want for got, want in zip(ours, expected))
    assert parted <= len(prompts) // 3, f"{parted} of {len(prompts)} sequences part from the reference"


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("name", sorted(TINY_SHAPES))
def test_llama_in_bfloat16_matches_transformers_in_bfloat16(tiny_llama_dirs, llama_references, name, backend):
    prompts = make_prompts(9, min_len=1, max_len=220)
    ours = run_bf16_greedy(tiny_llama_dirs[name], prompts, backend, block_size=16, max_num_batched_tokens=128)
    check_bf16(llama_references[name], prompts, ours)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("name", FAMILIES)
def test_families_in_bfloat16_match_transformers_in_bfloat16(family_dirs, name, backend):
    prompts = make_prompts(6, min_len=3, max_len=7 * WINDOW, seed=2)
    ours = run_bf16_greedy(family_dirs[name], prompts, backend, block_size=8)
    check_bf16(HFReference(family_dirs[name], dtype=torch.bfloat16, attn_implementation="eager"), prompts, ours)


@pytest.mark.skipif(not prefill_attention_cpu.available(), reason="needs the C prefill attention (AVX-512-BF16)")
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_c_prefill_attention_in_the_engine_matches_transformers(tmp_path_factory, monkeypatch, backend):
    """A head_dim of 64 (7 query heads per KV head) takes the C prefill kernel: whole prompts,
    chunks of 48 tokens and cached prefixes, as greedy as transformers in bfloat16."""
    shape = dict(num_attention_heads=14, num_key_value_heads=2, hidden_size=896, intermediate_size=256)
    model = save_tiny_llama(str(tmp_path_factory.mktemp("bf16-head-dim-64")), seed=4, initializer_range=0.05, **shape)
    calls = []
    kernel = prefill_attention_cpu.prefill_attention_cpu
    monkeypatch.setattr(cpu_attention, "prefill_attention_cpu", lambda *a: calls.append(1) or kernel(*a))
    shared = make_prompts(1, min_len=70, max_len=70, seed=5)[0]
    prompts = make_prompts(6, min_len=1, max_len=150, seed=6)
    prompts += [shared + p for p in prompts[:3]]
    args = dict(block_size=16, max_num_batched_tokens=48, enable_chunked_prefill=True, enable_prefix_caching=True)
    ours = run_bf16_greedy(model, prompts, backend, **args)
    assert calls
    check_bf16(HFReference(model, dtype=torch.bfloat16), prompts, ours)


def save_as(src: str, dst: str, dtype: torch.dtype) -> str:
    """``src``'s checkpoint stored in ``dtype`` (its config then names that dtype)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(src, dtype=dtype).save_pretrained(dst, safe_serialization=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


ZEN4 = "fpu sse avx2 avx512f avx512bw avx512vl avx512_bf16"
ICE_LAKE = "fpu sse avx2 avx512f avx512bw avx512vl avx512_vnni"
ZEN3 = "fpu sse avx avx2 fma"


@pytest.mark.parametrize(
    ("stored", "flags", "gemm", "expected"),
    [
        (torch.bfloat16, ZEN4, None, torch.bfloat16),
        (torch.float16, ZEN4, None, torch.bfloat16),
        (torch.bfloat16, ICE_LAKE, None, torch.float32),
        (torch.float32, ZEN4, None, torch.float32),
        pytest.param(
            torch.bfloat16,
            ZEN3,
            "avx2",
            torch.bfloat16,
            marks=pytest.mark.skipif(not bf16_gemm_cpu.runs("avx2"), reason="needs AVX2, FMA, Numba and a C compiler"),
        ),
    ],
)
def test_auto_dtype_on_cpu_is_chosen_from_checkpoint_and_cpu_and_logged(
    tiny_llama, tmp_path, monkeypatch, caplog, stored, flags, gemm, expected
):
    """``gemm``: the variant of the engine's bf16 GEMM this CPU is made to run (None: none)."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\n")
    monkeypatch.setattr(dtype_choice, "CPUINFO", str(cpuinfo))
    monkeypatch.setattr(bf16_gemm_cpu, "isa", lambda: gemm)
    model = save_as(tiny_llama, str(tmp_path / "model"), stored)
    with caplog.at_level(logging.INFO, logger="pagedllm.server.worker.model_runner"):
        llm = LLM(model=model, num_gpu_blocks_override=16, cpu_threads=1)
    runner = llm.llm_engine.runner
    assert runner.dtype == expected
    assert runner.ops.name == "numba"
    assert f"the model computes in {str(expected).removeprefix('torch.')} (" in caplog.text
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.skipif(not decode_scores_cpu.available(), reason="needs an x86-64 CPU with AVX-512-BF16 and a C compiler")
def test_qwen3_in_bfloat16_decodes_through_the_c_attention_item(family_dirs, monkeypatch):
    """Heads of 32 over 16-slot blocks: the decode kernel runs each work item in C (decode_scores_cpu.c)."""
    paths = []
    real = decode_scores_cpu.c_path
    monkeypatch.setattr(decode_scores_cpu, "c_path", lambda *a: paths.append(real(*a)) or paths[-1])
    prompts = make_prompts(6, min_len=3, max_len=7 * WINDOW, seed=2)
    ours = run_bf16_greedy(family_dirs["qwen3"], prompts, "numba", block_size=16)
    assert paths and set(paths) == {2}
    check_bf16(HFReference(family_dirs["qwen3"], dtype=torch.bfloat16, attn_implementation="eager"), prompts, ours)
