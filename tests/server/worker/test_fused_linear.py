"""q/k/v and gate/up fused into one GEMM each on every device: CUDA takes the CPU's fusion
(without the oneDNN packing), a tensor-parallel shard fuses its own rows, LoRA keeps them apart."""

from __future__ import annotations

import pytest
import torch

from pagedllm.server.worker.models.cpu_linear import is_packed
from pagedllm.server.worker.models.decoder import DecoderForCausalLM
from pagedllm.server.worker.models.fused_linear import FusedLinear, finish_linears
from pagedllm.server.worker.models.tensor_parallel import TPGroup

CUDA = torch.device("cuda")  # NOTE: only its type is read: the path a CUDA runner takes, on CPU tensors


def _config() -> dict:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
    ).to_dict()


def _random_decoder(tp: TPGroup = TPGroup()) -> DecoderForCausalLM:
    torch.manual_seed(0)
    model = DecoderForCausalLM.from_hf_config(_config(), tp)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    return model.eval()


def _projections(layer) -> tuple[torch.Tensor, ...]:
    """q, k, v, gate, up of one layer for a fixed input, fused or not."""
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    attn, mlp = layer.self_attn, layer.mlp
    qkv = attn.qkv_proj(x) if attn.qkv_proj is not None else (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
    gate_up = mlp.gate_up_proj(x) if mlp.gate_up_proj is not None else (mlp.gate_proj(x), mlp.up_proj(x))
    return (*qkv, *gate_up)


def test_the_cuda_path_fuses_without_packing():
    model = _random_decoder()
    before = [_projections(layer) for layer in model.model.layers]
    assert finish_linears(model, CUDA, lora=False) == (2 * len(model.model.layers), 0)
    for layer, want in zip(model.model.layers, before):
        assert isinstance(layer.self_attn.qkv_proj, FusedLinear) and isinstance(layer.mlp.gate_up_proj, FusedLinear)
        assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "up_proj")
        assert not is_packed(layer.self_attn.qkv_proj.weight)  # NOTE: packed layouts are the CPU's alone
        for got, ref in zip(_projections(layer), want):
            torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


def test_the_cuda_path_keeps_projections_apart_for_lora():
    model = _random_decoder()
    assert finish_linears(model, CUDA, lora=True) == (0, 0)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj is None and layer.mlp.gate_up_proj is None
    assert layer.self_attn.q_proj.weight.shape == (64, 64)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_shard_fuses_its_own_rows(rank):
    full = _random_decoder()
    shard = DecoderForCausalLM.from_hf_config(_config(), TPGroup(rank, 2)).eval()
    shard.load_weights((name, t.clone()) for name, t in full.state_dict().items())
    want = _projections(full.model.layers[1])
    finish_linears(shard, CUDA, lora=False)
    got = _projections(shard.model.layers[1])
    # rank r holds heads r*2, r*2+1 of q (16 dims each), KV head r, and half of gate/up's columns
    cuts = [(rank * 32, 32), (rank * 16, 16), (rank * 16, 16), (rank * 48, 48), (rank * 48, 48)]
    assert [t.shape[-1] for t in got] == [n for _, n in cuts]
    for g, w, (start, n) in zip(got, want, cuts):
        torch.testing.assert_close(g, w[:, start : start + n], atol=1e-6, rtol=1e-6)
