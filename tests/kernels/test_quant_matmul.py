"""quant_matmul: the packing against a hand-built word, the Triton W4A16/W8A16 GEMM against a
float64 oracle, tile choice, and the launcher's checks."""

import pytest
import torch
from kernel_factories import DEVICE, gpu_test

from pagedllm.kernels.quant_matmul import (
    Tiles,
    choose_tiles,
    dequantize_reference,
    pack_along_k,
    unpack_along_k,
    w4a16_matmul,
    w4a16_matmul_reference,
)

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=1e-2)}


def _random_case(m, k, n, bits, group_size, act_order, dtype, device=DEVICE):
    """Random codes, scales and zero points; with ``act_order`` a shuffled GPTQ ``g_idx``."""
    groups = -(-k // group_size)
    q = torch.randint(0, 2**bits, (k, n))
    scales = torch.rand(groups, n) * 0.02 + 0.001
    zeros = torch.randint(0, 2**bits, (groups, n)).float()
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // group_size)[torch.randperm(k)].to(torch.int32).to(device)
    x = torch.randn(m, k).to(dtype)
    return x.to(device), pack_along_k(q, bits).to(device), scales.to(device), zeros.to(device), g_idx, q


def _oracle(x, q, scales, zeros, group_size, g_idx):
    """float64 ``x @ W`` from the unpacked codes, independent of the packing code."""
    g = g_idx.long().cpu() if g_idx is not None else torch.arange(q.shape[0]) // group_size
    w = (q.double() - zeros.cpu().double()[g]) * scales.cpu().double()[g]
    return x.cpu().double() @ w


def test_pack_puts_element_k_at_its_bits():
    q = torch.zeros(16, 2, dtype=torch.int64)
    q[0, 0], q[1, 0], q[7, 0], q[9, 1] = 1, 2, 15, 5
    words = pack_along_k(q, 4)
    assert words.shape == (2, 2) and words.dtype == torch.int32
    assert int(words[0, 0]) == 1 | (2 << 4) | -(1 << 28)  # 15 << 28 wraps to a negative int32
    assert int(words[1, 1]) == 5 << 4
    assert torch.equal(unpack_along_k(words, 4), q)


@pytest.mark.parametrize("bits", [4, 8])
def test_unpack_inverts_pack(seed, bits):
    q = torch.randint(0, 2**bits, (64, 5))
    assert torch.equal(unpack_along_k(pack_along_k(q, bits), bits), q), f"seed={seed}"


@pytest.mark.parametrize("bits", [4, 8])
def test_reference_matches_oracle(seed, bits):
    x, qw, s, z, g_idx, q = _random_case(5, 64, 12, bits, 16, True, torch.float32, device="cpu")
    expected = _oracle(x, q, s, z, 16, g_idx)
    actual = w4a16_matmul_reference(x, qw, s, z, 16, g_idx, bits).double()
    torch.testing.assert_close(actual, expected, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "bits,m,k,n,group_size,act_order",
    [
        (4, 1, 128, 48, 32, False),
        (4, 3, 256, 40, 128, False),
        (4, 17, 128, 64, 16, True),
        (4, 5, 96, 33, 32, True),  # K and N not tile multiples
        (4, 7, 128, 32, -1, False),  # one group per column
        (8, 1, 128, 48, 64, False),
        (8, 9, 64, 72, 32, True),
        (8, 71, 64, 24, 16, False),  # a prefill-sized tile
    ],
)
def test_kernel_matches_oracle(seed, dtype, bits, m, k, n, group_size, act_order):
    gs = k if group_size == -1 else group_size
    x, qw, s, z, g_idx, q = _random_case(m, k, n, bits, gs, act_order, dtype)
    y = w4a16_matmul(x, qw, s, z, group_size, g_idx, bits)
    assert y.dtype == dtype and y.shape == (m, n)
    assert not torch.isnan(y).any(), f"seed={seed}"
    expected = _oracle(x, q, s, z, gs, g_idx)
    torch.testing.assert_close(y.cpu().double(), expected, **TOL[dtype], msg=lambda e: f"seed={seed}: {e}")


def test_kernel_reads_strided_x_and_half_scales(seed):
    wide = torch.randn(6, 200).to(DEVICE)
    x = wide[:, 8:136]  # [6, 128], row stride 200
    _, qw, s, z, _, q = _random_case(6, 128, 40, 4, 64, False, torch.float32)
    y = w4a16_matmul(x, qw, s.half(), z.half(), 64)
    expected = _oracle(x, q, s.half().float(), z.half().float(), 64, None)
    torch.testing.assert_close(y.cpu().double(), expected, **TOL[torch.float32], msg=lambda e: f"seed={seed}: {e}")


def test_dequantize_reference_uses_g_idx():
    q = torch.tensor([[3], [5]])
    w = dequantize_reference(pack_along_k(torch.cat([q, torch.zeros(6, 1, dtype=torch.int64)]), 4),
                             torch.tensor([[2.0], [10.0]]), torch.tensor([[1.0], [0.0]]), 4,
                             torch.tensor([1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.int32))  # fmt: skip
    assert w[:2, 0].tolist() == [30.0, 8.0]  # row 0 in group 1: 3 * 10; row 1 in group 0: (5 - 1) * 2


@pytest.mark.parametrize("tiles", [Tiles(16, 64, 256, 4, 3), Tiles(32, 16, 16, 4, 2)])
def test_explicit_tiles_give_the_same_product(seed, tiles):
    # a K tile longer than the group (gathered scales) and one shorter than it
    x, qw, s, z, _, q = _random_case(3, 256, 80, 4, 64, False, torch.float32)
    y = w4a16_matmul(x, qw, s, z, 64, tiles=tiles)
    expected = _oracle(x, q, s, z, 64, None)
    torch.testing.assert_close(y.cpu().double(), expected, **TOL[torch.float32], msg=lambda e: f"seed={seed}: {e}")


def test_tiles_for_decode_and_prefill():
    assert choose_tiles(1, 128, False).block_m == 16
    assert choose_tiles(33, 128, False).block_m == 64
    assert choose_tiles(1, 32, False).block_k == 32  # the tile stays inside one group
    assert choose_tiles(1, 32, True).block_k == 128  # act-order gathers per row anyway
    assert choose_tiles(512, 128, False).block_m == 128


def test_launcher_rejects_bad_arguments():
    x = torch.randn(2, 64)
    qw = torch.zeros(8, 16, dtype=torch.int32)
    s = torch.ones(2, 16)
    with pytest.raises(ValueError, match="bits"):
        w4a16_matmul(x, qw, s, s, 32, bits=3)
    with pytest.raises(ValueError, match="qweight must be int32"):
        w4a16_matmul(x, qw[:4], s, s, 32)
    with pytest.raises(ValueError, match="scales must be float"):
        w4a16_matmul(x, qw, s[:1], s, 32)
    with pytest.raises(ValueError, match="tiles must be"):
        w4a16_matmul(x, qw, s, s, 32, tiles=Tiles(16, 16, 8, 4, 2))
    with pytest.raises(ValueError, match="g_idx must be int32"):
        w4a16_matmul(x, qw, s, s, 32, g_idx=torch.zeros(64, dtype=torch.int64))


@pytest.mark.parametrize("m", [1, 16, 64, 300])
@gpu_test
def test_kernel_matches_reference_on_gpu_bf16(seed, m):
    x, qw, s, z, g_idx, q = _random_case(m, 4096, 512, 4, 128, False, torch.bfloat16)
    y = w4a16_matmul(x, qw, s.bfloat16(), z.bfloat16(), 128)
    expected = w4a16_matmul_reference(x.float(), qw, s.bfloat16(), z.bfloat16(), 128)
    torch.testing.assert_close(y.float(), expected, atol=5e-2, rtol=2e-2, msg=lambda e: f"seed={seed}: {e}")
