"""The compiled int4 unpacking against its torch reference: bit for bit, whole or a tile of columns at a time."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import int4_unpack_cpu as int4_unpack
from pagedllm.kernels.int4_unpack_cpu import int4_unpack_cpu, int4_unpack_reference, torch_block, unpack_levels


def packed_weight(n: int, k: int, group: int, dtype: torch.dtype, seed: int = 0):
    """torch's packed CPU int4 bytes of random levels, and random (scale, offset) pairs, as Int4CpuKernel keeps them."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_and_zeros = (torch.rand(k // group, n, 2, generator=gen) - 0.5).to(dtype)
    return q, packed, scales_and_zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 128])
def test_the_whole_weight_equals_the_reference_bit_for_bit(dtype, group):
    n, k = 192, 256
    q, packed, sz = packed_weight(n, k, group, dtype)
    out = int4_unpack_cpu(packed, sz, group, torch.empty(k, n, dtype=dtype))
    want = int4_unpack_reference(packed, sz, group, dtype)
    assert torch.equal(out, want)
    # NOTE: the reference reads the layout right: levels and group scales land where they belong
    scales, offsets = sz[..., 0].float(), sz[..., 1].float()
    plain = (q.float() - 8) * scales.T.repeat_interleave(group, 1) + offsets.T.repeat_interleave(group, 1)
    assert torch.equal(want, plain.T.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tile_of_columns_is_those_columns(dtype):
    n, k, group = 256, 128, 64
    _, packed, sz = packed_weight(n, k, group, dtype, seed=1)
    want = int4_unpack_reference(packed, sz, group, dtype)
    tile = torch.empty(k, 128, dtype=dtype)
    for first in (0, 128):
        assert torch.equal(int4_unpack_cpu(packed, sz, group, tile, first), want[:, first : first + 128])


def test_what_the_kernel_does_not_take_goes_through_torch():
    n, k, group = 128, 64, 32
    _, packed, sz = packed_weight(n, k, group, torch.float32, seed=2)
    want = int4_unpack_reference(packed, sz, group, torch.float64)
    assert torch.equal(int4_unpack_cpu(packed, sz, group, torch.empty(k, n, dtype=torch.float64)), want)
    narrow = torch.empty(k, 32, dtype=torch.float32)  # NOTE: not whole blocks of 64 columns
    assert torch.equal(int4_unpack_cpu(packed, sz, group, narrow, 64), want[:, 64:96].float())


def test_torch_packs_in_the_block_its_cpu_capability_gives():
    assert torch_block() == (64 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 32)


def hand_packed(q: torch.Tensor, block: int) -> torch.Tensor:
    """torch's layout written out by hand: byte (b, k, i) = q[Bb + i, k] | q[Bb + B/2 + i, k] << 4."""
    n, k = q.shape
    rows = q.to(torch.uint8).reshape(n // block, 2, block // 2, k)
    return (rows[:, 0] | (rows[:, 1] << 4)).transpose(1, 2).contiguous().reshape(n, k // 2)


@pytest.mark.parametrize("block", [64, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_either_block_unpacks_to_the_plain_weight(monkeypatch, block, dtype):
    # NOTE: torch packs blocks of 64 rows on AVX-512 CPUs and of 32 on AVX2 ones; both are unpacked here
    monkeypatch.setattr(int4_unpack, "torch_block", lambda: block)
    n, k, group = 192, 128, 32
    gen = torch.Generator().manual_seed(block)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    packed = hand_packed(q, block)
    assert torch.equal(unpack_levels(packed, block), q.to(torch.uint8))
    sz = (torch.rand(k // group, n, 2, generator=gen) - 0.5).to(dtype)
    out = int4_unpack_cpu(packed, sz, group, torch.empty(k, n, dtype=dtype))
    scales, offsets = sz[..., 0].float(), sz[..., 1].float()
    plain = (q.float() - 8) * scales.T.repeat_interleave(group, 1) + offsets.T.repeat_interleave(group, 1)
    assert torch.equal(out, plain.T.to(dtype))
    assert torch.equal(int4_unpack_reference(packed, sz, group, dtype), out)
