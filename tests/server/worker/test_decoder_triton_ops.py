"""The decoder's layer ops on Triton (add + RMSNorm, rotary, SiLU-and-mul): CPU tensors keep
their own kernels; the Triton path, forced on through the interpreter and on a GPU, gives
transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch
from engine_factories import HFReference, assert_greedy_matches, make_prompts
from family_factories import save_tiny_family

from pagedllm.server import LLM, SamplingParams
from pagedllm.server.worker.models import decoder, rope

MAX_TOKENS = 6
TRITON_OPS = (
    (decoder, "fused_add_rms_norm"),
    (decoder, "rms_norm"),
    (decoder, "act_and_mul"),
    (rope, "rotary_embedding"),
)


def _greedy(model_dir, prompts, **engine_args):
    llm = LLM(model=model_dir, block_size=16, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def _count_calls(monkeypatch) -> dict[str, int]:
    calls = {name: 0 for _, name in TRITON_OPS}
    for module, name in TRITON_OPS:

        def counted(*args, _fn=getattr(module, name), _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def test_cpu_tensors_never_reach_the_triton_ops(tiny_llama, monkeypatch):
    calls = _count_calls(monkeypatch)
    _greedy(tiny_llama, make_prompts(2, min_len=3, max_len=9, seed=1), device="cpu", cpu_threads=1)
    assert not any(calls.values()), calls


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])  # + q/k norms; + Gemma's norms and GeGLU
def test_triton_ops_forced_on_give_transformers_tokens(family, tiny_llama, tmp_path, monkeypatch):
    # NOTE: Triton's interpreter runs the kernels on CPU tensors (tests/conftest.py sets it)
    model_dir = tiny_llama if family == "llama" else save_tiny_family(str(tmp_path / family), family)
    calls = _count_calls(monkeypatch)
    for module in (decoder, rope):
        monkeypatch.setattr(module, "runs_on_triton", lambda t: True)
    prompts = make_prompts(3, min_len=2, max_len=20, seed=2)
    got = _greedy(model_dir, prompts, device="cpu", cpu_threads=1, attention_backend="torch")
    assert all(calls.values()), calls
    ref = HFReference(model_dir, attn_implementation="eager")
    for prompt, ours in zip(prompts, got):
        assert_greedy_matches(ref, prompt, ours, ref.greedy(prompt, MAX_TOKENS))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_layers_give_transformers_tokens(tiny_llama, monkeypatch):
    calls = _count_calls(monkeypatch)
    prompts = make_prompts(8, min_len=1, max_len=90, seed=3)
    got = _greedy(tiny_llama, prompts, device="cuda", dtype="float32", enforce_eager=True)
    assert all(calls.values()), calls
    ref = HFReference(tiny_llama)
    for prompt, ours in zip(prompts, got):
        assert_greedy_matches(ref, prompt, ours, ref.greedy(prompt, MAX_TOKENS))
