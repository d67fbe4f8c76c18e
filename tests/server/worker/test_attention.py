"""Attention backends: one class per name, chosen by select_attention_ops, one interface."""

import pytest
import torch

from pagedllm.server.worker.attention import (
    BACKENDS,
    AttentionMetadata,
    AttentionOps,
    CpuAttention,
    NumbaAttention,
    TorchAttention,
    TritonAttention,
    select_attention_ops,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "name,cls", [("numba", NumbaAttention), ("torch", TorchAttention), ("triton", TritonAttention)]
)
def test_each_backend_name_maps_to_its_class(name, cls):
    ops = select_attention_ops(name, CPU, torch.float32)
    assert type(ops) is cls
    assert ops.name == name
    assert isinstance(ops, AttentionOps)


def test_exactly_three_backends_and_the_cpu_ones_share_their_base():
    assert BACKENDS == {"numba": NumbaAttention, "torch": TorchAttention, "triton": TritonAttention}
    assert issubclass(NumbaAttention, CpuAttention) and issubclass(TorchAttention, CpuAttention)
    assert not issubclass(TritonAttention, CpuAttention)
    for method in ("prefill", "prepare", "reshape_and_cache", "copy_blocks"):
        assert method not in vars(NumbaAttention) and method not in vars(TorchAttention)
    with pytest.raises(TypeError):
        AttentionOps()  # type: ignore[abstract]


def test_the_environment_overrides_auto_only(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "torch")
    assert type(select_attention_ops("auto", CPU)) is TorchAttention
    assert type(select_attention_ops("numba", CPU)) is NumbaAttention


@pytest.mark.parametrize("name", ["flash", "", "Torch"])
def test_an_unknown_name_is_rejected_with_the_allowed_ones(name):
    expected = f"attention backend {name!r} is not allowed: choose one of ['auto', 'numba', 'torch', 'triton']"
    with pytest.raises(ValueError) as err:
        select_attention_ops(name, CPU)
    assert str(err.value) == expected


def _step(block_size: int, gen: torch.Generator) -> tuple[AttentionMetadata, tuple]:
    """Two decodes (contexts 5 and 11) and one prompt chunk of 3 tokens over a cached prefix of 6."""
    heads, kv_heads, head_dim, num_blocks = 4, 2, 8, 8
    cache = [torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen) for _ in range(2)]
    tables = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([1 * 8 + 4, 4 * 8 + 2, 5 * 8 + 6, 5 * 8 + 7, 6 * 8 + 0]),
        num_decode_tokens=2,
        decode_block_tables=tables[:2],
        decode_context_lens=torch.tensor([5, 11], dtype=torch.int32),
        prefill_block_tables=tables[2:],
        prefill_cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32),
        prefill_context_lens=torch.tensor([9], dtype=torch.int32),
    )
    q = torch.randn(5, heads, head_dim, generator=gen)
    k, v = torch.randn(5, kv_heads, head_dim, generator=gen), torch.randn(5, kv_heads, head_dim, generator=gen)
    return meta, (q, k, v, *cache)


def _attend(ops: AttentionOps, meta: AttentionMetadata, q, k, v, key_cache, value_cache) -> torch.Tensor:
    ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
    decode = ops.decode(q[:2], key_cache, value_cache, meta, 0.3, None, None)
    prefill = ops.prefill(q[2:], k[2:], v[2:], key_cache, value_cache, meta, 0.3, None, None)
    return torch.cat([decode, prefill])


def test_the_cpu_backends_agree_prepared_or_not():
    """Both CPU backends give the same step output; without ``prepare`` they plan it themselves."""
    meta, tensors = _step(8, torch.Generator().manual_seed(0))
    outs = []
    for ops in (NumbaAttention(), TorchAttention()):
        prepared = ops.prepare(meta, 8)
        assert prepared.plan is not None and meta.plan is None
        assert (prepared.plan.compiled is not None) == (ops.name == "numba")
        outs.append(_attend(ops, prepared, *[t.clone() for t in tensors]))
        outs.append(_attend(ops, meta, *[t.clone() for t in tensors]))
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=2e-5, rtol=1e-4)


def test_the_cpu_backends_copy_blocks_in_every_layer():
    gen = torch.Generator().manual_seed(1)
    for ops in (NumbaAttention(), TorchAttention()):
        caches = [torch.randn(4, 2, 1, 3, generator=gen) for _ in range(4)]
        before = [c.clone() for c in caches]
        ops.copy_blocks(caches[:2], caches[2:], torch.tensor([[0, 3], [2, 1]]))
        for c, b in zip(caches, before):
            torch.testing.assert_close(c[3], b[0])
            torch.testing.assert_close(c[1], b[2])
            torch.testing.assert_close(c[[0, 2]], b[[0, 2]])
