"""Linear layers on packed weights (oneDNN's layout, or the bf16 kernel's): same products as
``F.linear``, packed once, never twice in memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import bf16_gemm_cpu
from pagedllm.server.worker.attention import AttentionMetadata, select_attention_ops
from pagedllm.server.worker.models import cpu_linear
from pagedllm.server.worker.models.cpu_linear import (
    can_pack,
    is_packed,
    linear,
    pack_weight,
    packed_kernel,
    prepack_linears,
)
from pagedllm.server.worker.models.decoder import DecoderForCausalLM
from pagedllm.server.worker.models.fused_linear import FusedLinear, fuse_projections
from pagedllm.server.worker.models.tensor_parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    mark_shard,
)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, rows, bias):
    if dtype == torch.bfloat16 and not cpu_linear.onednn_bf16():
        pytest.skip("oneDNN runs no bfloat16 GEMM on this CPU (it needs AVX-512 or AVX-NE-CONVERT)")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = (torch.randn(72, 96, generator=g) * 0.1).to(dtype)
    b = torch.randn(72, generator=g).to(dtype) if bias else None
    packed = pack_weight(w)
    assert packed.is_mkldnn and packed.shape == w.shape and packed.dtype == dtype  # NOTE: 72 rows: no 16-column blocks
    got, want = linear(x, packed, b), F.linear(x, w, b)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_packed_linear_takes_any_leading_shape():
    x, w = torch.randn(2, 3, 16), torch.randn(8, 16)
    torch.testing.assert_close(linear(x, pack_weight(w)), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_plain_weights_take_f_linear():
    x, w = torch.randn(4, 16, dtype=torch.float16), torch.randn(8, 16, dtype=torch.float16)
    assert not can_pack(w)  # NOTE: float16 stays plain: oneDNN has no fast float16 GEMM on these CPUs
    assert torch.equal(linear(x, w), F.linear(x, w))


def _tiny_decoder(tie: bool, qkv_bias: bool = False) -> DecoderForCausalLM:
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
        attention_bias=qkv_bias,
    ).to_dict()
    torch.manual_seed(0)
    model = DecoderForCausalLM.from_hf_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    return model.eval()


@pytest.mark.parametrize("tie", [False, True])
def test_prepack_packs_every_projection_once_and_keeps_names(tie):
    model = _tiny_decoder(tie)
    names = {n: p.shape for n, p in model.named_parameters()}
    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    packed = prepack_linears(model)
    assert packed == len(linears) + 1
    if tie:  # NOTE: the head's packed copy is a parameter of its own now, of the table's shape
        names["lm_head.weight"] = names["model.embed_tokens.weight"]
    assert {n: p.shape for n, p in model.named_parameters()} == names
    assert all(is_packed(m.weight) for m in linears)
    head = next(m for m in model.modules() if isinstance(m, ParallelLMHead))
    # NOTE: a tied head packs a copy of its own; lookups index the embedding's plain table.
    assert is_packed(head.weight)
    assert not is_packed(model.model.embed_tokens.weight)
    assert prepack_linears(model) == 0  # packed weights are not packed again


def test_prepack_keeps_the_shard_rule_loading_marked():
    # NOTE: at TP > 1 loading marks each rank's slice on the parameter; LoRA reads it after packing.
    model = _tiny_decoder(False)
    q_proj = model.model.layers[0].self_attn.q_proj
    rule = lambda full: full.narrow(0, 0, 8)  # noqa: E731
    mark_shard(q_proj.weight, rule)
    prepack_linears(model)
    assert is_packed(q_proj.weight) and q_proj.weight.shard is rule


def _logits(model: DecoderForCausalLM) -> torch.Tensor:
    """Logits of a 12-token prompt prefilled from empty caches (the torch attention backend)."""
    ops = select_attention_ops("torch", torch.device("cpu"))
    num_layers, kv_heads, head_dim = model.kv_shape
    tokens = 12
    shape = (2, 8, kv_heads, head_dim)
    dtype = model.model.embed_tokens.weight.dtype
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(tokens),
        num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 2, dtype=torch.int32),
        decode_context_lens=torch.zeros(0, dtype=torch.int32),
        prefill_block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
        prefill_cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32),
        prefill_context_lens=torch.tensor([tokens], dtype=torch.int32),
    )
    with torch.inference_mode():
        hidden = model(torch.arange(tokens) % 50, torch.arange(tokens), caches, ops.prepare(meta, 8), ops)
        return model.compute_logits(hidden)


def test_bf16_weights_stay_plain_where_no_bf16_gemm_runs(monkeypatch):
    # NOTE: on a CPU with AVX2 only, oneDNN refuses to reorder a bfloat16 weight (a RuntimeError
    # at load); such a model must load and run on F.linear.
    monkeypatch.setattr(cpu_linear, "onednn_bf16", lambda: False)
    monkeypatch.setattr(bf16_gemm_cpu, "available", lambda: False)
    model = _tiny_decoder(tie=True, qkv_bias=True).to(torch.bfloat16)
    assert not can_pack(model.model.layers[0].mlp.down_proj.weight)
    assert can_pack(torch.zeros(16, 16))  # float32 weights still pack
    before = _logits(model)
    assert prepack_linears(model) == 0
    assert not any(is_packed(p) for p in model.parameters())
    assert torch.equal(_logits(model), before)


@pytest.mark.skipif(not cpu_linear.onednn_bf16(), reason="oneDNN runs no bfloat16 GEMM on this CPU")
def test_bf16_weights_pack_for_onednn_where_it_runs_bf16(monkeypatch):
    monkeypatch.setattr(bf16_gemm_cpu, "available", lambda: False)
    w = torch.randn(80, 96).to(torch.bfloat16)
    assert can_pack(w) and packed_kernel(pack_weight(w)) == "onednn-packed"


@pytest.mark.skipif(not bf16_gemm_cpu.available(), reason="needs the bf16 GEMM (AVX-512-BF16 or AVX2)")
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_weights_with_16_column_blocks_take_the_bf16_kernel(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    w = (torch.randn(80, 96, generator=g) * 0.1).to(torch.bfloat16)
    b = torch.randn(80, generator=g).to(torch.bfloat16) if bias else None
    packed = pack_weight(w)
    assert packed_kernel(packed) == "bf16-tiles" and is_packed(packed) and not packed.is_mkldnn
    assert packed.shape == w.shape and not can_pack(packed)
    torch.testing.assert_close(linear(x, packed, b).float(), F.linear(x, w, b).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not bf16_gemm_cpu.available(), reason="needs the bf16 GEMM (AVX-512-BF16 or AVX2)")
def test_a_bf16_decoder_runs_on_the_bf16_kernel_with_the_same_logits():
    model = _tiny_decoder(tie=False, qkv_bias=True).to(torch.bfloat16)
    before = _logits(model)
    prepack_linears(model)
    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert {packed_kernel(m.weight) for m in linears} == {"bf16-tiles"}
    after = _logits(model)
    torch.testing.assert_close(after.float(), before.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("tie", [False, True])
def test_prepacked_decoder_gives_the_same_logits(tie):
    model = _tiny_decoder(tie=tie)
    before = _logits(model)
    prepack_linears(model)
    after = _logits(model)
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    assert torch.equal(after.argmax(-1), before.argmax(-1))


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_fused_projections_give_the_same_logits(qkv_bias):
    model = _tiny_decoder(tie=False, qkv_bias=qkv_bias)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    parts = [attention.q_proj.weight.clone(), attention.k_proj.weight.clone(), attention.v_proj.weight.clone()]
    before = _logits(model)
    assert fuse_projections(model) == 2 * len(model.model.layers)
    assert not hasattr(attention, "q_proj") and not hasattr(mlp, "gate_proj")
    assert attention.qkv_proj is not None and mlp.gate_up_proj is not None
    assert torch.equal(attention.qkv_proj.weight, torch.cat(parts))
    assert (attention.qkv_proj.bias is not None) is qkv_bias
    assert prepack_linears(model) == 4 * len(model.model.layers) + 1  # qkv, o, gate-up, down; the head
    torch.testing.assert_close(_logits(model), before, atol=1e-4, rtol=1e-4)


def test_fused_linear_splits_its_output_and_fills_missing_biases():
    g = torch.Generator().manual_seed(0)
    a, b = torch.nn.Linear(16, 8, bias=True), torch.nn.Linear(16, 4, bias=False)
    for p in (*a.parameters(), *b.parameters()):
        p.data = torch.randn(p.shape, generator=g)
    fused = FusedLinear([a, b])
    x = torch.randn(3, 16, generator=g)
    out_a, out_b = fused(x)
    assert fused.sizes == [8, 4] and out_a.shape == (3, 8) and out_b.shape == (3, 4)
    torch.testing.assert_close(out_a, a(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_b, b(x), atol=1e-5, rtol=1e-5)


def test_cpu_engine_packs_its_projections(tmp_path):
    from pagedllm.server import LLM
    from tests.server.family_factories import save_tiny_family

    llm = LLM(model=save_tiny_family(str(tmp_path), "mistral-window"), block_size=8, num_gpu_blocks_override=8)
    model = llm.llm_engine.runner.model
    # NOTE: float32: oneDNN's layout, or the float32 kernel's on a CPU with AVX2 and no AVX-512
    assert is_packed(model.model.layers[0].self_attn.qkv_proj.weight)  # fused, then packed
    assert is_packed(model.model.layers[0].mlp.gate_up_proj.weight)
    assert is_packed(model.model.layers[1].mlp.down_proj.weight)
    assert is_packed(model.lm_head.weight)


def test_cpu_engine_keeps_projections_apart_for_lora(tmp_path):
    # NOTE: adapters hook q_proj, k_proj, ... by name, so with LoRA on nothing is fused
    from pagedllm.server import LLM
    from tests.server.family_factories import save_tiny_family

    path = save_tiny_family(str(tmp_path), "mistral-window")
    llm = LLM(model=path, block_size=8, num_gpu_blocks_override=8, enable_lora=True, max_loras=1)
    layer = llm.llm_engine.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj is None and is_packed(layer.self_attn.q_proj.weight)
    assert layer.mlp.gate_up_proj is None and is_packed(layer.mlp.gate_proj.weight)
