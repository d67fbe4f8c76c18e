"""Rotary embeddings against transformers' own rotary modules, config reading, and greedy
tokens of tiny LLaMA checkpoints with scaled RoPE against transformers."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_factories import HFReference, assert_greedy_matches, make_prompts
from transformers import AutoConfig, Gemma2Config, Gemma3TextConfig, LlamaConfig, Phi3Config
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply_rotary
from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rotary
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from pagedllm.server import LLM, SamplingParams
from pagedllm.server.demo import save_tiny_llama
from pagedllm.server.worker.models.rope import ROPE_TYPES, RotaryEmbedding, rope_parameters_for

ATOL = 1e-5
HEAD_DIM = 32
SHAPE = dict(hidden_size=4 * HEAD_DIM, num_attention_heads=4, num_key_value_heads=2)
# LongRoPE lists shaped like Phi-3's: short factors near 1, long ones growing to ~40.
SHORT = [1.0 + 0.01 * i**1.5 for i in range(HEAD_DIM // 2)]
LONG = [1.0 + 0.15 * i**2 for i in range(HEAD_DIM // 2)]


def ours(config, max_positions: int, layer_type: str | None = None) -> RotaryEmbedding:
    """Our rotary embedding from the config's config.json dict, as the model builds it."""
    params = rope_parameters_for(config.to_dict(), layer_type)
    return RotaryEmbedding(HEAD_DIM, max_positions, params)


def hf_prefill(module, length: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin for positions 0..length-1 in one forward call: [length, dim]."""
    cos, sin = module(torch.zeros(1), torch.arange(length)[None], **kwargs)
    return cos[0], sin[0]


def hf_decode(module, start: int, stop: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin for positions start..stop-1, one position per call as when
    generating with a cache: [stop - start, dim]."""
    rows = [module(torch.zeros(1), torch.tensor([[p]]), **kwargs) for p in range(start, stop)]
    return torch.cat([cos[0] for cos, _ in rows]), torch.cat([sin[0] for _, sin in rows])


def assert_rows(rope: RotaryEmbedding, start: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    stop = start + cos.shape[0]
    torch.testing.assert_close(rope.get_buffer("cos")[start:stop], cos, atol=ATOL, rtol=0)
    torch.testing.assert_close(rope.get_buffer("sin")[start:stop], sin, atol=ATOL, rtol=0)


STATIC = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.5},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-betas-untruncated": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
    "yarn-attention-factor": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "attention_factor": 1.3,
    },
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_types_equal_transformers_within_and_past_the_trained_length(name):
    config = LlamaConfig(**SHAPE, max_position_embeddings=256, rope_parameters={**STATIC[name], "rope_theta": 5000.0})
    rope = ours(config, 400)
    assert_rows(rope, 0, *hf_prefill(LlamaRotaryEmbedding(config), 400))


def test_yarn_attention_factor_scales_cos_and_sin():
    config = LlamaConfig(**SHAPE, max_position_embeddings=256, rope_parameters={**STATIC["yarn"], "rope_theta": 1e4})
    emb = ours(config, 8)
    norm = (emb.get_buffer("cos") ** 2 + emb.get_buffer("sin") ** 2).sqrt()
    torch.testing.assert_close(norm, torch.full_like(norm, 0.1 * torch.log(torch.tensor(4.0)).item() + 1.0))


@pytest.mark.parametrize("factor", [2.0, 1.7])
def test_dynamic_ntk_equals_transformers_within_max_positions_and_when_decoding_past(factor):
    config = LlamaConfig(
        **SHAPE, max_position_embeddings=100, rope_parameters={"rope_type": "dynamic", "factor": factor}
    )
    rope = ours(config, 300)
    assert_rows(rope, 0, *hf_prefill(LlamaRotaryEmbedding(config), 100))
    assert_rows(rope, 0, *hf_prefill(LlamaRotaryEmbedding(LlamaConfig(**SHAPE, max_position_embeddings=100)), 100))
    assert_rows(rope, 90, *hf_decode(LlamaRotaryEmbedding(config), 90, 300))


def phi3_config(**overrides) -> Phi3Config:
    rope = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG}
    values = dict(SHAPE, max_position_embeddings=256, original_max_position_embeddings=64, rope_parameters=rope)
    return Phi3Config(**{**values, **overrides})


@pytest.mark.parametrize(
    "extra", [{}, {"attention_factor": 1.2}, {"factor": 2.0}], ids=["derived", "attention_factor", "factor"]
)
def test_longrope_equals_phi3_within_the_original_length_and_when_decoding_past(extra):
    config = phi3_config(rope_parameters={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, **extra})
    rope = ours(config, 300)
    assert_rows(rope, 0, *hf_prefill(Phi3RotaryEmbedding(config), 64))
    assert_rows(rope, 60, *hf_decode(Phi3RotaryEmbedding(config), 60, 300))


def test_a_prompt_prefilled_past_the_original_length_keeps_short_factors_below_it():
    # transformers rotates all of a 100-token prompt with the long factors; positions below
    # 64 keep the short ones here, so that their cached K stays valid as the sequence grows.
    config = phi3_config()
    rope = ours(config, 100)
    cos, sin = hf_prefill(Phi3RotaryEmbedding(config), 100)
    assert_rows(rope, 64, cos[64:], sin[64:])
    assert (rope.get_buffer("cos")[1:64] - cos[1:64]).abs().max() > 1e-2


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_a_position_rotates_the_same_whatever_the_table_length(kind):
    config = (
        phi3_config()
        if kind == "longrope"
        else LlamaConfig(**SHAPE, max_position_embeddings=50, rope_scaling={"rope_type": "dynamic", "factor": 3.0})
    )
    short, long = ours(config, 120), ours(config, 400)
    assert torch.equal(short.get_buffer("cos"), long.get_buffer("cos")[:120])
    assert torch.equal(short.get_buffer("sin"), long.get_buffer("sin")[:120])


@pytest.mark.parametrize("rope", ["default", "longrope"])
def test_partial_rotary_factor_turns_the_first_dims_and_passes_the_rest(rope):
    half = HEAD_DIM // 4  # pairs in the rotated half of each head
    params = {"rope_type": "default"}
    if rope == "longrope":
        params = {"rope_type": "longrope", "short_factor": SHORT[:half], "long_factor": LONG[:half]}
    config = phi3_config(partial_rotary_factor=0.5, rope_parameters=params)
    emb = ours(config, 300)
    assert emb.rotary_dim == HEAD_DIM // 2
    (within_cos, within_sin), (past_cos, past_sin) = (
        hf_prefill(Phi3RotaryEmbedding(config), 64),
        hf_decode(Phi3RotaryEmbedding(config), 64, 300),
    )
    assert_rows(emb, 0, within_cos, within_sin)
    assert_rows(emb, 64, past_cos, past_sin)

    positions = torch.tensor([5, 0, 63, 64, 250])
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4 * HEAD_DIM, generator=g), torch.randn(5, 2 * HEAD_DIM, generator=g)
    got_q, got_k = emb(positions, q.clone(), k.clone())  # NOTE: rotated in place
    cos, sin = torch.cat([within_cos, past_cos]), torch.cat([within_sin, past_sin])
    want_q, want_k = phi3_apply_rotary(
        q.view(5, 4, HEAD_DIM), k.view(5, 2, HEAD_DIM), cos[positions], sin[positions], unsqueeze_dim=1
    )
    torch.testing.assert_close(got_q, want_q.reshape(5, -1), atol=ATOL, rtol=0)
    torch.testing.assert_close(got_k, want_k.reshape(5, -1), atol=ATOL, rtol=0)
    torch.testing.assert_close(
        got_q.view(5, 4, HEAD_DIM)[..., HEAD_DIM // 2 :], q.view(5, 4, HEAD_DIM)[..., HEAD_DIM // 2 :]
    )


def test_forward_rotates_query_and_key_heads_as_transformers():
    config = LlamaConfig(**SHAPE, max_position_embeddings=256, rope_parameters={**STATIC["yarn"], "rope_theta": 1e4})
    emb = ours(config, 256)
    positions = torch.tensor([200, 3, 3, 0, 77, 255])
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(6, 4 * HEAD_DIM, generator=g), torch.randn(6, 2 * HEAD_DIM, generator=g)
    got_q, got_k = emb(positions, q.clone(), k.clone())  # NOTE: rotated in place
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), positions[None])
    want_q, want_k = llama_apply_rotary(
        q.view(6, 4, HEAD_DIM).transpose(0, 1)[None], k.view(6, 2, HEAD_DIM).transpose(0, 1)[None], cos, sin
    )
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1).reshape(6, -1), atol=ATOL, rtol=0)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1).reshape(6, -1), atol=ATOL, rtol=0)


def gemma3_config(**overrides) -> Gemma3TextConfig:
    values = dict(SHAPE, head_dim=HEAD_DIM, num_hidden_layers=6, max_position_embeddings=256)
    return Gemma3TextConfig(**{**values, **overrides})


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_gemma3_rotates_each_layer_type_with_its_own_parameters(layer_type):
    config = gemma3_config(rope_scaling={"rope_type": "linear", "factor": 8.0})
    rope = ours(config, 300, layer_type)
    assert_rows(rope, 0, *hf_prefill(Gemma3RotaryEmbedding(config), 300, layer_type=layer_type))


# config.json dicts in the older style (rope_theta + rope_scaling, legacy names), as the Hub
# still has them; transformers' config class reads each one as the reference.
LEGACY = {
    "llama-type-key": dict(
        model_type="llama", rope_theta=5e5, rope_scaling={"type": "dynamic", "factor": 2.0}, max_position_embeddings=64
    ),
    "llama3.1": dict(
        model_type="llama",
        rope_theta=5e5,
        max_position_embeddings=512,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2-yarn": dict(
        model_type="qwen2",
        rope_theta=1e6,
        max_position_embeddings=256,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "phi3-partial": dict(
        model_type="phi3",
        max_position_embeddings=256,
        original_max_position_embeddings=64,
        partial_rotary_factor=0.5,
        rope_scaling={"type": "longrope", "short_factor": SHORT[:8], "long_factor": LONG[:8]},
    ),
    "phi3-named-yarn": dict(
        model_type="phi3",
        max_position_embeddings=256,
        original_max_position_embeddings=64,
        rope_scaling={"type": "yarn", "short_factor": SHORT, "long_factor": LONG},
    ),
    "mistral": dict(model_type="mistral", rope_theta=1e6, max_position_embeddings=256),
}


ROTARY_MODULES = {
    "llama": LlamaRotaryEmbedding,
    "qwen2": Qwen2RotaryEmbedding,
    "phi3": Phi3RotaryEmbedding,
    "mistral": MistralRotaryEmbedding,
}


@pytest.mark.parametrize("name", sorted(LEGACY))
def test_legacy_config_fields_read_as_transformers_reads_them(name):
    raw = {**LEGACY[name], **SHAPE, "head_dim": HEAD_DIM}
    # NOTE: config classes fill in the dicts they are given; the reference gets its own copy.
    config = AutoConfig.for_model(**copy.deepcopy(raw))
    module = ROTARY_MODULES[raw["model_type"]](config)
    params = rope_parameters_for(raw)
    trained = params.get("original_max_position_embeddings") or params["max_position_embeddings"]
    rope = RotaryEmbedding(HEAD_DIM, 300, params)
    assert_rows(rope, 0, *hf_prefill(module, trained))
    assert_rows(rope, trained - 2, *hf_decode(module, trained - 2, 300))


def test_su_is_read_as_longrope():
    # Early Phi-3 configs name LongRoPE "su" (transformers 5 no longer loads them).
    longrope = LEGACY["phi3-partial"]
    su = {**longrope, "rope_scaling": {**longrope["rope_scaling"], "type": "su"}}
    assert rope_parameters_for(su) == rope_parameters_for(longrope)
    assert rope_parameters_for(su)["rope_type"] == "longrope"


def test_gemma3_legacy_fields_and_defaults():
    legacy = dict(
        model_type="gemma3_text",
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    one_type = {
        "model_type": "gemma3_text",
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0}},
    }
    for raw in (legacy, one_type, {"model_type": "gemma3_text"}):
        config = Gemma3TextConfig(**copy.deepcopy({**raw, **SHAPE, "head_dim": HEAD_DIM, "num_hidden_layers": 6}))
        for layer_type in ("sliding_attention", "full_attention"):
            rope = RotaryEmbedding(HEAD_DIM, 300, rope_parameters_for(raw, layer_type))
            assert_rows(rope, 0, *hf_prefill(Gemma3RotaryEmbedding(config), 300, layer_type=layer_type))


def test_layer_type_is_ignored_where_every_layer_rotates_alike():
    raw = Gemma2Config(**SHAPE, head_dim=HEAD_DIM, rope_theta=2e4).to_dict()
    sliding, full = rope_parameters_for(raw, "sliding_attention"), rope_parameters_for(raw, "full_attention")
    assert sliding == full == rope_parameters_for(raw)
    assert sliding["rope_theta"] == 2e4


def test_parameters_merge_the_top_level_keys():
    rope = {"rope_type": "longrope", "short_factor": SHORT[:8], "long_factor": LONG[:8]}
    raw = phi3_config(partial_rotary_factor=0.5, rope_parameters=rope).to_dict()
    params = rope_parameters_for(raw)
    assert params["rope_type"] == "longrope"
    assert (params["max_position_embeddings"], params["original_max_position_embeddings"]) == (256, 64)
    assert params["partial_rotary_factor"] == 0.5
    plain = rope_parameters_for({"rope_theta": 5e5, "max_position_embeddings": 2048})
    assert plain == {"rope_type": "default", "rope_theta": 5e5, "max_position_embeddings": 2048}
    yarn = rope_parameters_for({"rope_scaling": {"type": "yarn", "factor": 4.0}, "max_position_embeddings": 2048})
    assert yarn["original_max_position_embeddings"] == 2048 and "type" not in yarn


def test_unknown_rope_type_is_refused_naming_it_and_the_choices():
    with pytest.raises(ValueError, match=r"rope_type='mystery' is not supported: choose one of .*'longrope'"):
        rope_parameters_for({"rope_scaling": {"rope_type": "mystery", "factor": 2.0}})
    with pytest.raises(ValueError, match="mystery") as err:
        RotaryEmbedding(HEAD_DIM, 16, {"rope_type": "mystery"})
    assert all(name in str(err.value) for name in ROPE_TYPES)


def test_missing_parameters_and_layer_types_are_refused_by_name():
    with pytest.raises(ValueError, match="long_factor"):
        RotaryEmbedding(HEAD_DIM, 16, {"rope_type": "longrope", "short_factor": SHORT, "max_position_embeddings": 8})
    with pytest.raises(ValueError, match="factor.*required for rope_type 'linear'"):
        RotaryEmbedding(HEAD_DIM, 16, {"rope_type": "linear"})
    with pytest.raises(ValueError, match=r"layer_type=None .*'full_attention', 'sliding_attention'"):
        rope_parameters_for(gemma3_config().to_dict())


# End to end: greedy tokens of tiny LLaMA checkpoints with scaled RoPE, through the engine.
MAX_TOKENS = 12
E2E = {
    # name -> (LlamaConfig overrides, prompt lengths)
    "linear": (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), (1, 200)),
    "yarn": (
        dict(
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 1e4,
            },
        ),
        (1, 200),
    ),
    # Prompts within max_position_embeddings, where transformers' frequencies are the plain ones.
    "dynamic": (
        dict(max_position_embeddings=128, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
        (1, 110),
    ),
    # Prompts within the original 64 positions whose generated tokens cross it: both switch to
    # the long factors for positions 64 and up, one token at a time.
    "longrope": (
        dict(
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "longrope",
                "short_factor": SHORT[:8],
                "long_factor": [4.0 + 2.0 * i for i in range(8)],
                "original_max_position_embeddings": 64,
                "rope_theta": 1e4,
            },
        ),
        (54, 64),
    ),
}


@pytest.mark.parametrize("name", sorted(E2E))
def test_greedy_tokens_equal_transformers_with_scaled_rope(tmp_path, name):
    overrides, (shortest, longest) = E2E[name]
    model_dir = save_tiny_llama(str(tmp_path / name), seed=3, initializer_range=0.2, **overrides)
    ref = HFReference(model_dir)
    prompts = make_prompts(5, min_len=shortest, max_len=longest, seed=7)
    llm = LLM(model=model_dir, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs):
        assert_greedy_matches(ref, prompt, out.outputs[0].token_ids, ref.greedy(prompt, MAX_TOKENS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_and_k_of_one_fused_projection_turn_in_one_call_as_they_would_apart(dtype, monkeypatch):
    from pagedllm.server.worker.models import rope as rope_module

    emb = RotaryEmbedding(HEAD_DIM, 64, {"rope_type": "default", "rope_theta": 10000.0})
    positions = torch.tensor([0, 5, 17, 63])
    qkv = torch.randn(4, (4 + 2 + 2) * HEAD_DIM).to(dtype)  # q | k | v columns
    q, k, v = qkv.split([4 * HEAD_DIM, 2 * HEAD_DIM, 2 * HEAD_DIM], dim=-1)
    want_q, want_k = emb(positions, q.clone(), k.clone())  # apart: two calls
    v_before = v.clone()
    calls = []
    real = rope_module.rotary_cpu_
    monkeypatch.setattr(rope_module, "rotary_cpu_", lambda x, *args: calls.append(x.shape) or real(x, *args))
    got_q, got_k = emb(positions, q, k)
    assert calls == [torch.Size([4, 6 * HEAD_DIM])]
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(v, v_before)
    # columns that are not neighbours, or of different tensors, still go apart
    calls.clear()
    emb(positions, q.clone(), k.clone())
    emb(positions, q, v)
    assert len(calls) == 4
