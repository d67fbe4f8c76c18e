"""Quantized checkpoints of every format against transformers on their dequantized twins: greedy tokens equal."""

from __future__ import annotations

import pytest
import torch
from engine_factories import HFReference, assert_greedy_matches, make_prompts
from quant_writers import F32_KERNEL, write_online, write_quantized

from pagedllm.kernels import w4_gemm_cpu
from pagedllm.server import LLM, SamplingParams
from pagedllm.server.config import EngineConfig
from pagedllm.server.worker.quantization.linear import QuantLinear, weight_bytes
from tests.support import assert_all_blocks_free

MAX_TOKENS = 10
LLM_CONFIG = EngineConfig.from_kwargs()
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
W8 = "needs AVX-512-BF16, VNNI and VBMI, numba and a C compiler (the 8-bit packing's int8 product)"

# (writer format, its options, the CPU kernel every layer must run; these models are float32: bfloat16 4-bit
# runs w4a16-tiles, tested at the end)
CASES = {
    "awq-g32": ("awq", {"group": 32}, "int4-cpu"),
    "awq-g64": ("awq", {"group": 64}, "int4-cpu"),
    "gptq-4bit-sym": ("gptq", {}, "int4-cpu"),
    "gptq-4bit-act-order-asym": ("gptq", {"desc_act": True, "sym": False}, "int4-cpu"),
    "gptq-8bit-channel": ("gptq", {"bits": 8, "group": -1}, "int8-cpu"),
    "gptq-8bit-g32-asym": ("gptq", {"bits": 8, "sym": False}, "dequantize"),
    "ct-w4a16": ("ct-pack", {}, "int4-cpu"),
    "ct-w4a16-asym-channel": ("ct-pack", {"sym": False, "group": -1}, "int4-cpu"),
    "ct-int8-w8a8": ("ct-int8", {}, "int8-w8a8-cpu"),
    "ct-fp8-w8a8": ("ct-fp8", {}, "dequantize"),
    "fp8-block": ("fp8-block", {}, "dequantize"),
}


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(5, min_len=1, max_len=70, seed=3)


def kernels(llm) -> set[str]:
    model = llm.llm_engine.runner.model
    return {m.kernel.name for m in model.modules() if isinstance(m, QuantLinear)}


def int8_activations(ref: HFReference, group: int | None = None) -> HFReference:
    """The reference with every projection's input quantized to int8 per token and back (what W8A8
    computes), or per ``group`` inputs of a token as ``w4a8-tiles`` rounds them (scale max / 127 in
    float32, levels x * (127 / max) rounded to nearest even)."""

    def fake_quant(module, args):
        x = args[0]
        scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-12)
        return (torch.round(x / scale) * scale,)

    def fake_quant_groups(module, args):
        x = args[0]
        grouped = x.float().unflatten(-1, (-1, min(group, x.shape[-1])))
        top = grouped.abs().amax(-1, keepdim=True)
        inverse = torch.where(top > 0, torch.tensor(127.0) / top, torch.zeros_like(top))
        return ((torch.round(grouped * inverse) * (top / 127.0)).flatten(-2).to(x.dtype),)

    hook = fake_quant if group is None else fake_quant_groups

    for name, module in ref.model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
            module.register_forward_pre_hook(hook)
    return ref


def check_greedy(llm, twin: str, prompts, **generate) -> None:
    ref = HFReference(twin)
    if "int8-w8a8-cpu" in kernels(llm):
        ref = int8_activations(ref)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, **generate)
    for prompt, out in zip(prompts, outputs):
        assert_greedy_matches(ref, prompt, out.outputs[0].token_ids, ref.greedy(prompt, MAX_TOKENS))


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_matches_transformers_on_the_dequantized_twin(tmp_path, prompts, case):
    fmt, options, kernel = CASES[case]
    qdir, twin = write_quantized(str(tmp_path), fmt, seed=len(case), **options)
    llm = LLM(model=qdir, block_size=16, num_gpu_blocks_override=64)
    assert kernels(llm) == {kernel}
    check_greedy(llm, twin, prompts)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(("kind", "kernel"), [("int8", "int8-cpu"), ("fp8", "dequantize")])
def test_online_quantization_matches_the_per_channel_twin(tmp_path, prompts, kind, kernel):
    plain, twin = write_online(str(tmp_path), kind)
    llm = LLM(model=plain, quantization=kind, block_size=16, num_gpu_blocks_override=64)
    assert kernels(llm) == {kernel}
    assert f"online-{kind} 8-bit per channel" in llm.llm_engine.runner.weights.banner()
    check_greedy(llm, twin, prompts)


def test_preemption_and_prefix_caching_on_awq(tmp_path, prompts):
    qdir, twin = write_quantized(str(tmp_path), "awq", seed=7)
    shared = prompts[0] + prompts[1]
    batch = [shared + p for p in prompts] + [shared]
    llm = LLM(model=qdir, block_size=8, num_gpu_blocks_override=24, enable_prefix_caching=True)
    check_greedy(llm, twin, batch)
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert_all_blocks_free(llm)


def test_banner_and_metrics_name_the_quantization(tmp_path):
    from pagedllm.server.entrypoints.openai.metrics import EngineStatsCollector

    qdir, twin = write_quantized(str(tmp_path), "gptq", seed=1)
    llm = LLM(model=qdir, block_size=16, num_gpu_blocks_override=16)
    mib = weight_bytes(llm.llm_engine.runner.model) / 2**20
    int4 = "int4-cpu-unpacked-float32"  # NOTE: a float32 model: the packed matmul has no fast float32 path
    # NOTE: the vocabulary is no multiple of 16: the LM head stays with oneDNN
    kernels = f"down_proj {int4}, gate_up_proj {int4}, lm_head onednn-packed, o_proj {int4}, qkv_proj {int4}"
    banner = f"weights          gptq gptq 4-bit group 32, kernels: {kernels}, weights {mib:.2f} MiB"
    assert banner in llm.llm_engine.describe()
    weights = llm.llm_engine.model_info.weights
    collector = EngineStatsCollector("tiny", llm.llm_engine.config, llm.llm_engine.stats, lambda: weights)
    [info] = [m for m in collector.collect() if m.name == "pagedllm:quant_config_info"]
    labels = info.samples[0].labels
    assert labels["method"] == "gptq" and labels["bits"] == "4" and labels["group_size"] == "32"
    assert labels["kernel_down_proj"] == int4
    assert labels["weight_bytes"] == str(weight_bytes(llm.llm_engine.runner.model))
    plain = LLM(model=twin, block_size=16, num_gpu_blocks_override=16).llm_engine
    assert plain.model_info.weights.labels()["method"] == "none"
    plain_kernels = f"kernels: down_proj {F32_KERNEL}, gate_up_proj {F32_KERNEL}"
    assert f"weights          none (32-bit), {plain_kernels}" in plain.describe()


def test_qwen2_biases_and_tied_embeddings_on_awq(tmp_path, prompts):
    qdir, twin = write_quantized(str(tmp_path), "awq", seed=6, family="qwen2")
    llm = LLM(model=qdir, block_size=16, num_gpu_blocks_override=64)
    assert kernels(llm) == {"int4-cpu"}
    check_greedy(llm, twin, prompts)


MOE_CASES = [("awq", {}, "int4-cpu"), ("gptq", {"desc_act": True}, "int4-cpu"), ("ct-fp8", {}, "dequantize")]


@pytest.mark.parametrize(("fmt", "options", "kernel"), MOE_CASES)
def test_mixture_of_experts_keeps_its_experts_quantized(tmp_path, prompts, fmt, options, kernel):
    from pagedllm.server.worker.models.moe import SparseMoeBlock

    qdir, twin = write_quantized(str(tmp_path), fmt, seed=4, family="mixtral", **options)
    llm = LLM(model=qdir, block_size=16, num_gpu_blocks_override=64)
    blocks = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b.quantized is not None and not hasattr(b, "w13") for b in blocks)
    expert_kernels = {m.kernel.name for b in blocks for m in b.modules() if isinstance(m, QuantLinear)}
    assert expert_kernels == {kernel}
    check_greedy(llm, twin, prompts)


@pytest.mark.parametrize(("kind", "kernel"), [("int8", "int8-cpu"), ("fp8", "dequantize")])
def test_online_quantization_quantizes_the_experts_too(tmp_path, prompts, kind, kernel):
    from pagedllm.server.worker.models.moe import SparseMoeBlock

    plain, twin = write_online(str(tmp_path), kind, seed=5, family="mixtral")
    llm = LLM(model=plain, quantization=kind, block_size=16, num_gpu_blocks_override=64)
    blocks = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b.quantized is not None for b in blocks)
    assert {m.kernel.name for b in blocks for m in b.modules() if isinstance(m, QuantLinear)} == {kernel}
    check_greedy(llm, twin, prompts)


def expert_bytes(llm) -> int:
    from pagedllm.server.worker.models.moe import SparseMoeBlock

    blocks = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    return sum(t.numel() * t.element_size() for b in blocks for t in [*b.parameters(), *b.buffers()])


def test_quantized_experts_take_a_fraction_of_the_plain_bytes(tmp_path):
    qdir, twin = write_quantized(str(tmp_path), "awq", seed=2, family="mixtral")
    quantized = expert_bytes(LLM(model=qdir, num_gpu_blocks_override=8))
    plain = expert_bytes(LLM(model=twin, num_gpu_blocks_override=8))
    assert quantized < 0.3 * plain  # NOTE: float32 twin; int4 with group-32 scales, plus the plain router


def test_quantized_weights_take_a_fraction_of_the_plain_bytes(tmp_path):
    qdir, twin = write_quantized(str(tmp_path), "awq", seed=2)

    def projection_bytes(llm) -> int:
        model = llm.llm_engine.runner.model
        layers = [
            m for name, m in model.named_modules() if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
        ]
        return sum(t.numel() * t.element_size() for m in layers for t in [*m.parameters(), *m.buffers()])

    quantized = projection_bytes(LLM(model=qdir, num_gpu_blocks_override=8))
    plain = projection_bytes(LLM(model=twin, num_gpu_blocks_override=8))
    assert quantized < 0.25 * plain  # float32 twin: 4 bytes a weight; int4 with group-32 scales: ~0.75


def test_the_weight_bytes_are_the_packed_bytes(tmp_path):
    """AWQ group 32 on the int4 CPU kernel: half a byte a weight, plus a float32 (scale, zero) pair per 32."""
    qdir, twin = write_quantized(str(tmp_path), "awq", seed=2)
    quantized, plain = LLM(model=qdir, num_gpu_blocks_override=8), LLM(model=twin, num_gpu_blocks_override=8)
    layers = [m for m in quantized.llm_engine.runner.model.modules() if isinstance(m, QuantLinear)]
    projection_weights = sum(m.shape[0] * m.shape[1] for m in layers)
    want = weight_bytes(plain.llm_engine.runner.model) - 4 * projection_weights + projection_weights * (0.5 + 8 / 32)
    assert weight_bytes(quantized.llm_engine.runner.model) == want
    assert f"weights {want / 2**20:.2f} MiB" in quantized.llm_engine.runner.weights.banner()


def test_bfloat16_awq_prefill_through_the_widened_weight_matches_transformers_in_bfloat16(tmp_path, monkeypatch):
    """Where the tiled kernel cannot run (here: told it cannot), bfloat16 stays on ``int4-cpu``: prompts of
    64+ tokens run their prefill through the widened-weight GEMM (``dense_rows``), decodes through the packed
    matmul: greedy tokens equal transformers in bfloat16 on the twin, by the bfloat16 tolerance of
    ``test_bfloat16_correctness``: at a first difference the reference's gap is under 0.5 nats (a bfloat16
    logit moves by 1/64 of its size). NOTE: no bound on how many sequences part: on this tiny random model
    transformers in bfloat16 parts from itself in float32 on 4 of these 6 prompts."""
    from pagedllm.server.worker.quantization import kernels as quant_kernels
    from pagedllm.server.worker.quantization.kernels import DENSE_ROWS_BFLOAT16, Int4CpuKernel
    from pagedllm.server.worker.quantization.w4a16_cpu import W4A16TilesKernel

    widened: list[int] = []
    unpacked_mm = Int4CpuKernel.unpacked_mm

    def spy(self, x):
        widened.append(x.shape[0])
        return unpacked_mm(self, x)

    monkeypatch.setattr(Int4CpuKernel, "unpacked_mm", spy)
    monkeypatch.setattr(W4A16TilesKernel, "fits", staticmethod(lambda w: False))
    monkeypatch.setattr(quant_kernels, "onednn_bf16", lambda: True)  # NOTE: the widened path, on any CPU
    qdir, twin = write_quantized(str(tmp_path), "awq", seed=11)
    llm = LLM(model=qdir, dtype="bfloat16", block_size=16, num_gpu_blocks_override=64, cpu_threads=1)
    assert kernels(llm) == {"int4-cpu"}
    long_prompts = make_prompts(6, min_len=DENSE_ROWS_BFLOAT16, max_len=120, seed=5)
    ref = HFReference(twin, dtype=torch.bfloat16)
    outputs = llm.generate([{"prompt_token_ids": p} for p in long_prompts], GREEDY)
    assert widened and min(widened) >= DENSE_ROWS_BFLOAT16
    for prompt, out in zip(long_prompts, outputs):
        assert_greedy_matches(ref, prompt, out.outputs[0].token_ids, ref.greedy(prompt, MAX_TOKENS), tol=0.5)
    assert_all_blocks_free(llm)


def labels(llm) -> set[str]:
    model = llm.llm_engine.runner.model
    return {m.kernel.label for m in model.modules() if isinstance(m, QuantLinear)}


@pytest.mark.skipif(
    not w4_gemm_cpu.available(), reason="needs an x86-64 CPU with AVX-512-BF16 or AVX2, numba and a C compiler"
)
@pytest.mark.parametrize("case", ["awq-g32", "gptq-4bit-act-order-asym", "ct-w4a16-asym-channel"])
def test_bfloat16_w4a16_runs_the_tiled_kernel_and_matches_transformers_in_bfloat16(tmp_path, case, monkeypatch):
    """A bfloat16 4-bit model runs ``w4a16-tiles`` in every projection (bfloat16 activations: the
    int8 ones switched off), for prefills of short and 64+ token prompts and for decodes: greedy
    tokens equal transformers in bfloat16 on the twin, by the tolerance of the test above (0.5 nats
    at a first difference)."""
    monkeypatch.setattr(w4_gemm_cpu, "int8_available", lambda: False)
    fmt, options, _ = CASES[case]
    qdir, twin = write_quantized(str(tmp_path), fmt, seed=len(case), **options)
    llm = LLM(model=qdir, dtype="bfloat16", block_size=16, num_gpu_blocks_override=64, cpu_threads=1)
    assert kernels(llm) == {"w4a16-tiles"} and labels(llm) == {"w4a16-tiles"}
    batch = make_prompts(3, min_len=1, max_len=20, seed=6) + make_prompts(3, min_len=64, max_len=120, seed=7)
    ref = HFReference(twin, dtype=torch.bfloat16)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    for prompt, out in zip(batch, outputs):
        assert_greedy_matches(ref, prompt, out.outputs[0].token_ids, ref.greedy(prompt, MAX_TOKENS), tol=0.5)
    assert_all_blocks_free(llm)


@pytest.mark.skipif(not w4_gemm_cpu.int8_available(), reason="needs AVX-512-VNNI and VBMI or AVX2, numba and a C")
@pytest.mark.parametrize(
    ("case", "group", "label"),
    [
        ("awq-g32", 32, "w4a8-tiles"),
        ("ct-w4a16-asym-channel", None, "w4a8-tiles"),
        *(
            pytest.param(case, group, "w8a8-tiles", marks=pytest.mark.skipif(not w4_gemm_cpu.w8_available(), reason=W8))
            for case, group in (("gptq-8bit-g32-asym", 32), ("gptq-8bit-channel", None))
        ),
    ],
)
def test_bfloat16_int8_activations_match_transformers_with_the_same_int8_inputs(tmp_path, case, group, label):
    """Where the CPU multiplies int8 (``w4a8-tiles`` and ``w8a8-tiles``, the default there for 4- and
    8-bit weights), every projection's input is rounded to int8 per group of the weight: greedy tokens
    equal transformers in bfloat16 on the twin with each projection's input rounded the same way, by
    the tolerance above. Groups are the checkpoint's (32) or, per channel, all of K (64 or 128 on this
    model). A GPTQ act-order weight's groups are its sorted inputs' (``test_w4a16_cpu.py`` checks that layer)."""
    fmt, options, _ = CASES[case]
    qdir, twin = write_quantized(str(tmp_path), fmt, seed=len(case), **options)
    llm = LLM(model=qdir, dtype="bfloat16", block_size=16, num_gpu_blocks_override=64, cpu_threads=1)
    assert labels(llm) == {label}
    batch = make_prompts(3, min_len=1, max_len=20, seed=6) + make_prompts(3, min_len=64, max_len=120, seed=7)
    ref = int8_activations(HFReference(twin, dtype=torch.bfloat16), group=group or 1 << 30)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    for prompt, out in zip(batch, outputs):
        assert_greedy_matches(ref, prompt, out.outputs[0].token_ids, ref.greedy(prompt, MAX_TOKENS), tol=0.5)
    assert_all_blocks_free(llm)
