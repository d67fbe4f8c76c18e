"""OPT and GPT-2: greedy tokens and logprobs against Hugging Face transformers on the same weights.

The tiny models use a 0.2 initializer (transformers' default is 0.02) so attention is sharp
enough that a wrong position table, a missed Conv1D transpose or the wrong layer-norm
placement changes the greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from engine_factories import HFReference, assert_greedy_matches, hf_config, make_prompts, save_tiny

from pagedllm.server import LLM, SamplingParams
from pagedllm.server.worker.models import model_class
from pagedllm.server.worker.models.gpt2 import GPT2LMHeadModel
from pagedllm.server.worker.models.opt import OPTForCausalLM
from tests.support import assert_all_blocks_free

MAX_TOKENS = 12

VARIANTS = {
    # name -> (family, config overrides)
    "opt-pre-ln": ("opt", dict(do_layer_norm_before=True)),
    "opt-post-ln-proj": ("opt", dict(do_layer_norm_before=False, word_embed_proj_dim=32)),  # like opt-350m
    "opt-pre-ln-proj-plain": (
        "opt",
        dict(word_embed_proj_dim=32, enable_bias=False, layer_norm_elementwise_affine=False, tie_word_embeddings=False),
    ),
    "gpt2": ("gpt2", dict()),
    "gpt2-inverse-layer-idx": (
        "gpt2",
        dict(scale_attn_by_inverse_layer_idx=True, activation_function="gelu_pytorch_tanh", tie_word_embeddings=False),
    ),
}
# The variants every engine configuration runs on; the others get the plain greedy + logprobs check.
CORE = ["opt-pre-ln", "opt-post-ln-proj", "gpt2"]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny matrices gain nothing from intra-op threads, and on a busy CI machine they spin."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")  # NOTE: the engine sets its thread count from it
        yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny-opt-gpt2")
    return {
        name: save_tiny(str(root / name), family, seed=i, **overrides)
        for i, (name, (family, overrides)) in enumerate(VARIANTS.items())
    }


@pytest.fixture(scope="module")
def references(model_dirs):
    return {name: HFReference(path) for name, path in model_dirs.items()}


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(6, min_len=1, max_len=150, seed=3)


@pytest.fixture(scope="module")
def expected(references, prompts):
    return {name: [ref.greedy(p, MAX_TOKENS) for p in prompts] for name, ref in references.items()}


def run_greedy(model_dir, prompts, **engine_args):
    llm = LLM(model=model_dir, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def check_greedy(ref, prompts, expected, outputs):
    for prompt, want, out in zip(prompts, expected, outputs):
        assert_greedy_matches(ref, prompt, out.outputs[0].token_ids, want)


def check_logprobs(ref, prompts, outputs):
    for prompt, out in zip(prompts, outputs):
        tokens = out.outputs[0].token_ids
        lp = ref.logprobs(prompt + tokens)[len(prompt) - 1 : -1]
        want = lp[torch.arange(len(tokens)), torch.tensor(tokens)]
        got = torch.tensor([out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(tokens)])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_and_logprobs_match_transformers(model_dirs, references, expected, prompts, name):
    llm, outputs = run_greedy(model_dirs[name], prompts, block_size=16)
    check_greedy(references[name], prompts, expected[name], outputs)
    check_logprobs(references[name], prompts, outputs)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("name", CORE)
def test_chunked_prefill_small_blocks_match(model_dirs, references, expected, prompts, name):
    llm, outputs = run_greedy(model_dirs[name], prompts, block_size=8, max_num_batched_tokens=32)
    assert max(len(p) for p in prompts) > 32
    check_greedy(references[name], prompts, expected[name], outputs)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "name, mode", [("opt-pre-ln", "recompute"), ("opt-post-ln-proj", "swap"), ("gpt2", "recompute")]
)
def test_preemption_matches(model_dirs, references, expected, prompts, name, mode):
    # 22 blocks of 8 tokens: the longest prompt and its output (162 tokens, 21 blocks) fit alone.
    # The 61- and 90-token prompts go first and fill the cache, so their decodes preempt.
    order = [2, 3, 0, 1, 4, 5]
    llm, outputs = run_greedy(
        model_dirs[name], [prompts[i] for i in order], block_size=8, num_gpu_blocks_override=22, preemption_mode=mode
    )
    assert llm.llm_engine.stats().num_preemptions > 0
    check_greedy(references[name], [prompts[i] for i in order], [expected[name][i] for i in order], outputs)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("name", ["opt-post-ln-proj", "gpt2"])
def test_dummy_weights_construct_and_run(model_dirs, name):
    llm = LLM(model=model_dirs[name], load_format="dummy", block_size=8)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params)
    assert len(out[0].outputs[0].token_ids) == 4
    for pname, param in llm.llm_engine.runner.model.named_parameters():
        if "norm" in pname or ".ln_" in pname:
            assert torch.all(param == (1.0 if pname.endswith("weight") else 0.0)), pname


def test_registry_maps_architectures():
    assert model_class({"architectures": ["OPTForCausalLM"]}) is OPTForCausalLM
    assert model_class({"architectures": ["GPT2LMHeadModel"]}) is GPT2LMHeadModel


def _checkpoint(model_dir):
    from safetensors.torch import load_file

    return load_file(f"{model_dir}/model.safetensors")


def _build(family: str, **overrides):
    cls = OPTForCausalLM if family == "opt" else GPT2LMHeadModel
    return cls.from_hf_config(hf_config(family, **overrides).to_dict())


def test_gpt2_loads_unprefixed_checkpoint_with_mask_buffers(model_dirs):
    """The original OpenAI checkpoints: no ``transformer.`` prefix, ``attn.bias`` causal-mask buffers."""
    state = _checkpoint(model_dirs["gpt2"])
    renamed = {k.removeprefix("transformer."): v for k, v in state.items()}
    renamed["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 256, 256))
    model = _build("gpt2")
    model.load_weights(renamed.items())
    w = state["transformer.h.1.attn.c_attn.weight"]  # Conv1D: [in, out]
    assert torch.equal(model.transformer.h[1].attn.c_attn.weight, w.t())


def test_opt_loads_decoder_prefixed_checkpoint(model_dirs):
    state = _checkpoint(model_dirs["opt-pre-ln"])
    model = _build("opt", do_layer_norm_before=True)
    model.load_weights((k.removeprefix("model."), v) for k, v in state.items())
    assert torch.equal(model.lm_head.weight, state["model.decoder.embed_tokens.weight"])


@pytest.mark.parametrize("family, name", [("opt", "opt-pre-ln"), ("gpt2", "gpt2")])
def test_load_weights_names_the_bad_tensor(model_dirs, family, name):
    state = _checkpoint(model_dirs[name])
    wrong_shape = next(k for k in state if k.endswith("fc1.weight") or k.endswith("c_fc.weight"))
    with pytest.raises(ValueError, match=wrong_shape):
        _build(family).load_weights({**state, wrong_shape: state[wrong_shape][:-1]}.items())
    with pytest.raises(ValueError, match="bogus.weight"):
        _build(family).load_weights({**state, "lm_head.bogus.weight": torch.zeros(1)}.items())
    with pytest.raises(ValueError, match="missing"):
        _build(family).load_weights((k, v) for k, v in state.items() if k != wrong_shape)


def test_unsupported_configs_are_rejected():
    with pytest.raises(ValueError, match="add_cross_attention"):
        _build("gpt2", add_cross_attention=True)
    with pytest.raises(ValueError, match="'mish'"):
        _build("opt", activation_function="mish")


def test_opt_final_layer_norm_follows_config():
    assert _build("opt", do_layer_norm_before=True).model.decoder.final_layer_norm is not None
    assert _build("opt", do_layer_norm_before=False).model.decoder.final_layer_norm is None
    assert _build("opt", _remove_final_layer_norm=True).model.decoder.final_layer_norm is None
