"""An 8-bit KV cache end to end: greedy outputs close to the model-dtype cache by vLLM's rule
(where the tokens first differ, each engine's token is among the other's top-5 logprobs),
under swap and recompute preemption, beams, prefix caching, speculation and sliding windows,
on several families; the block count follows the element size; nothing leaks."""

from __future__ import annotations

import pytest
import torch
from engine_factories import make_prompts, save_tiny
from family_factories import save_tiny_family

from pagedllm.kernels import prefill_attention_cpu
from pagedllm.server import LLM, SamplingParams
from pagedllm.server.config import ConfigError
from pagedllm.server.demo import save_tiny_llama
from pagedllm.server.worker import cpu_attention
from pagedllm.server.worker.kv_scales import split_kv_scales
from tests.support import assert_all_blocks_free

QUANTIZED = ["fp8", "fp8_e5m2", "int8"]
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(6, min_len=3, max_len=90, seed=3)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("kvq")
    return {
        "llama": tiny_llama,
        "opt": save_tiny(str(root / "opt"), "opt", seed=1),
        "qwen2": save_tiny_family(str(root / "qwen2"), "qwen2", seed=2),
        "mistral-window": save_tiny_family(str(root / "mistral"), "mistral-window", seed=3),
        "gemma2": save_tiny_family(str(root / "gemma2"), "gemma2", seed=4),
    }


def generate(model: str, prompts, params=PARAMS, **kwargs):
    llm = LLM(model=model, block_size=8, **kwargs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return llm, outputs


def assert_logprobs_close(ours, theirs) -> None:
    """vLLM's ``check_logprobs_close``: equal tokens, or at the first difference each engine's
    token is among the other's top logprobs at that position (nothing is compared after it)."""
    for a, b in zip(ours, theirs):
        for x, y in zip(a.outputs, b.outputs):
            for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)):
                if s != t:
                    assert s in y.logprobs[i] and t in x.logprobs[i], f"token {i}: {s} vs {t}"
                    break


# NOTE: e5m2 keeps 2 mantissa bits (up to 12.5% off per element at scale 1.0): on the tiny
# LLaMA and OPT, whose random weights give flat next-token distributions (top-1 near -2.3
# nats, top-5 within 1.3 of it), its first difference falls outside the top 5. It is checked
# on the other families; e4m3 and int8 on all.
CASES = [(f, d) for f in ("llama", "opt", "qwen2", "mistral-window", "gemma2") for d in QUANTIZED]
CASES = [c for c in CASES if c not in {("llama", "fp8_e5m2"), ("opt", "fp8_e5m2")}]


@pytest.mark.parametrize(("family", "kv_cache_dtype"), CASES)
def test_greedy_stays_close_to_the_model_dtype_cache(models, prompts, family, kv_cache_dtype):
    _, plain = generate(models[family], prompts)
    llm, ours = generate(models[family], prompts, kv_cache_dtype=kv_cache_dtype)
    assert llm.llm_engine.runner.kv_caches[0][0].dtype != torch.float32
    assert_logprobs_close(ours, plain)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_outputs_close(tiny_llama, prompts, backend, kv_cache_dtype, mode):
    _, plain = generate(tiny_llama, prompts)
    args = dict(kv_cache_dtype=kv_cache_dtype, attention_backend=backend, num_gpu_blocks_override=16)
    llm, ours = generate(tiny_llama, prompts, preemption_mode=mode, **args)
    assert llm.llm_engine.stats().num_preemptions > 0
    assert_logprobs_close(ours, plain)
    assert_all_blocks_free(llm)


@pytest.mark.xfail(
    strict=True,
    reason="a CPU prefill chunk attends over its own K/V unquantized (for accuracy), decode over the "
    "cache's: a sequence recomputed after preemption prefills its generated tokens, which then see "
    "other K/V than when they were decoded (e4m3 differs here at the third token)",
)
def test_recompute_preemption_gives_the_tokens_of_a_roomy_e4m3_cache(tiny_llama, prompts):
    args = dict(kv_cache_dtype="fp8", attention_backend="numba")
    _, roomy = generate(tiny_llama, prompts, num_gpu_blocks_override=512, **args)
    llm, tight = generate(tiny_llama, prompts, num_gpu_blocks_override=16, preemption_mode="recompute", **args)
    assert llm.llm_engine.stats().num_preemptions > 0
    assert_all_blocks_free(llm)
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_swapped_beams_come_back_bit_for_bit(tiny_llama, prompts, kv_cache_dtype):
    """A swap moves an 8-bit block (values and int8 scales) out and back unchanged: the beams
    are exactly those of the same cache with room to spare."""
    params = SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0, max_tokens=10, ignore_eos=True)
    _, free = generate(tiny_llama, prompts[:4], params, kv_cache_dtype=kv_cache_dtype, num_gpu_blocks_override=512)
    tight, squeezed = generate(
        tiny_llama,
        prompts[:4],
        params,
        kv_cache_dtype=kv_cache_dtype,
        num_gpu_blocks_override=20,
        preemption_mode="swap",
    )
    assert tight.llm_engine.stats().num_preemptions > 0
    assert [[o.token_ids for o in r.outputs] for r in squeezed] == [[o.token_ids for o in r.outputs] for r in free]
    assert_all_blocks_free(tight)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_beam_search_stays_close(tiny_llama, prompts, kv_cache_dtype):
    beams = dict(beam_width=3, max_tokens=8, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts[:3]]
    plain = LLM(model=tiny_llama, block_size=8).beam_search(batch, **beams)
    llm = LLM(model=tiny_llama, block_size=8, kv_cache_dtype=kv_cache_dtype)
    ours = llm.beam_search(batch, **beams)
    for a, b in zip(ours, plain):
        # NOTE: beams on near-tied random logits may take another path (even a better one):
        # the best beam's log-probability per token stays close instead
        assert len(a.outputs) == 3 and all(len(o.token_ids) == 8 for o in a.outputs)
        assert a.outputs[0].cumulative_logprob / 8 == pytest.approx(b.outputs[0].cumulative_logprob / 8, abs=0.25)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_prefix_cache_hits_read_the_8bit_blocks(tiny_llama, kv_cache_dtype):
    shared = make_prompts(1, min_len=40, max_len=40, seed=9)[0]
    prompts = [shared + tail for tail in make_prompts(4, min_len=3, max_len=12, seed=10)]
    _, plain = generate(tiny_llama, prompts)
    llm = LLM(model=tiny_llama, block_size=8, kv_cache_dtype=kv_cache_dtype)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts[:1]], PARAMS)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], PARAMS)
    assert llm.llm_engine.stats().prefix_cache_hits > 0
    assert_logprobs_close(first + rest, plain)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("spec", ["ngram", "draft_model"])
def test_speculation_over_an_int8_cache(tiny_llama, prompts, spec):
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    if spec == "draft_model":
        config = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3}
    _, plain = generate(tiny_llama, prompts, kv_cache_dtype="int8")
    llm, ours = generate(tiny_llama, prompts, kv_cache_dtype="int8", speculative_config=config)
    engine = llm.llm_engine
    if spec == "draft_model":
        assert engine.draft.runner.kv_caches[0][0].dtype == torch.int8
    assert engine.stats().spec_decode.num_accepted_tokens > 0
    assert_logprobs_close(ours, plain)
    assert_all_blocks_free(llm)


def test_tensor_parallel_ranks_each_hold_their_heads_in_int8(tiny_llama, prompts):
    _, single = generate(tiny_llama, prompts[:3], kv_cache_dtype="int8")
    llm, split = generate(tiny_llama, prompts[:3], kv_cache_dtype="int8", tensor_parallel_size=2)
    assert_logprobs_close(split, single)
    assert_all_blocks_free(llm)
    llm.llm_engine.shutdown()


def test_the_block_count_follows_the_element_size(tiny_llama):
    def blocks(**kwargs) -> int:
        llm = LLM(model=tiny_llama, block_size=16, kv_cache_memory=0.001, **kwargs)
        return llm.llm_engine.block_manager.gpu.num_blocks

    bf16, fp32 = blocks(dtype="bfloat16"), blocks(dtype="float32")
    assert blocks(dtype="bfloat16", kv_cache_dtype="fp8") == 2 * bf16
    assert blocks(dtype="float32", kv_cache_dtype="fp8_e5m2") == 4 * fp32
    # int8 rows carry a 2-byte scale: head_dim 8 here, so 10 bytes a row instead of 16
    assert blocks(dtype="bfloat16", kv_cache_dtype="int8") == int(bf16 * 16 / 10)


def test_a_bad_value_is_refused_naming_the_allowed_ones(tiny_llama):
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='fp4'.*\['auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2', 'int8'\]"):
        LLM(model=tiny_llama, kv_cache_dtype="fp4")


def test_the_banner_and_metrics_say_which_cache_runs(tiny_llama):
    llm = LLM(model=tiny_llama, kv_cache_dtype="fp8", num_gpu_blocks_override=8)
    assert "float8_e4m3fn" in llm.llm_engine.describe()
    assert llm.llm_engine.config.cache.kv_cache_dtype == "fp8"


def test_checkpoint_scales_are_taken_out_of_the_weights():
    found: dict = {}
    weights = [
        ("model.layers.0.self_attn.k_scale", torch.tensor(0.5)),
        ("model.layers.0.self_attn.q_proj.weight", torch.zeros(2, 2)),
        ("model.layers.1.self_attn.v_proj.output_scale", torch.tensor([0.25])),
        ("model.layers.2.self_attn.kv_scale", torch.tensor(2.0)),
    ]
    kept = list(split_kv_scales(weights, found))
    assert [name for name, _ in kept] == ["model.layers.0.self_attn.q_proj.weight"]
    assert found == {0: {"k": 0.5}, 1: {"v": 0.25}, 2: {"k": 2.0, "v": 2.0}}


@pytest.fixture(scope="module")
def scaled_llama(tmp_path_factory, tiny_llama):
    """The tiny LLaMA with compressed-tensors style ``k_scale`` / ``v_scale`` per layer."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("scaled") / "llama"
    shutil.copytree(tiny_llama, path)
    weights = load_file(str(path / "model.safetensors"))
    for layer in range(2):
        weights[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.05 * (layer + 1))
        weights[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.02)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def test_checkpoint_scales_reach_every_layer_and_outputs_stay_close(scaled_llama, tiny_llama, prompts):
    from pagedllm.server.worker.attention import PagedAttention

    llm, ours = generate(scaled_llama, prompts, kv_cache_dtype="fp8")
    layers = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, PagedAttention)]
    assert [(a.kv_scales.k_scale, a.kv_scales.v_scale) for a in layers] == [
        (pytest.approx(0.05), pytest.approx(0.02)),
        (pytest.approx(0.1), pytest.approx(0.02)),
    ]
    _, plain = generate(tiny_llama, prompts)
    assert_logprobs_close(ours, plain)
    _, auto = generate(scaled_llama, prompts)  # NOTE: a model-dtype cache loads the same checkpoint, scales unused
    assert [o.outputs[0].token_ids for o in auto] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_a_bfloat16_model_over_an_8bit_cache(tiny_llama, prompts, backend, kv_cache_dtype):
    _, plain = generate(tiny_llama, prompts, dtype="bfloat16", attention_backend=backend)
    llm, ours = generate(
        tiny_llama, prompts, dtype="bfloat16", attention_backend=backend, kv_cache_dtype=kv_cache_dtype
    )
    assert_logprobs_close(ours, plain)
    assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def head_dim_64_llama(tmp_path_factory):
    """A LLaMA with heads of 64 (7 query heads per KV head): the shape the C prefill attention takes."""
    shape = dict(num_attention_heads=14, num_key_value_heads=2, hidden_size=896, intermediate_size=256)
    return save_tiny_llama(str(tmp_path_factory.mktemp("head-dim-64")), seed=4, initializer_range=0.05, **shape)


@pytest.mark.skipif(not prefill_attention_cpu.available(), reason="needs the C prefill attention (AVX-512-BF16)")
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_bfloat16_prefill_over_an_8bit_cache_runs_in_the_c_kernel(head_dim_64_llama, monkeypatch, kv_cache_dtype):
    """Whole prompts, chunks of 48 tokens, cached prefixes and recompute after preemption, all
    prefilled by the C kernel reading the 8-bit cache (every chunk's K/V as the cache holds
    it): close to a bfloat16 cache."""
    shared = make_prompts(1, min_len=70, max_len=70, seed=5)[0]
    prompts = make_prompts(6, min_len=1, max_len=150, seed=6)
    prompts += [shared + p for p in prompts[:3]]
    args = dict(block_size=16, max_num_batched_tokens=48, enable_chunked_prefill=True, enable_prefix_caching=True)
    args.update(dtype="bfloat16", cpu_threads=1)
    batch = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=5)  # long enough to preempt
    plain = LLM(model=head_dim_64_llama, num_gpu_blocks_override=512, **args).generate(batch, params)
    calls = []
    kernel = prefill_attention_cpu.prefill_attention_cpu
    monkeypatch.setattr(cpu_attention, "prefill_attention_cpu", lambda *a: calls.append(a[1].dtype) or kernel(*a))
    tight = dict(num_gpu_blocks_override=16, preemption_mode="recompute")
    llm = LLM(model=head_dim_64_llama, kv_cache_dtype=kv_cache_dtype, **tight, **args)
    ours = llm.generate(batch, params)
    assert set(calls) == {llm.llm_engine.runner.kv_caches[0][0].dtype} != {torch.bfloat16}
    assert llm.llm_engine.stats().num_preemptions > 0 and llm.llm_engine.stats().prefix_cache_hits > 0
    if kv_cache_dtype != "fp8_e5m2":  # NOTE: flat random logits again (see CASES): e5m2 is run, not compared
        assert_logprobs_close(ours, plain)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_the_triton_backend_over_an_8bit_cache(tiny_llama, prompts, kv_cache_dtype):
    """Under Triton's interpreter here (slow: two prompts, few tokens); on CUDA where there is one."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
    _, plain = generate(tiny_llama, prompts[:2], params)
    llm, ours = generate(tiny_llama, prompts[:2], params, attention_backend="triton", kv_cache_dtype=kv_cache_dtype)
    assert llm.llm_engine.runner.ops.name == "triton"
    assert_logprobs_close(ours, plain)
    assert_all_blocks_free(llm)
