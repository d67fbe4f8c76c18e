"""quant_matmul: the packing against a hand-built word, the Triton W4A16/W8A16 GEMM and the
few-row gemv kernel against a float64 oracle, tile choice, and the launcher's checks."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_factories import DEVICE, gpu_test

from pagedllm.kernels.quant_gemv import GEMV_MAX_ROWS
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


@pytest.fixture
def poisoned_empty(monkeypatch):
    """``torch.empty`` that fills float tensors with NaN: an output element (or a split-K partial
    sum) the kernel never writes then fails the comparison."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)


# (bits, group_size, act_order): a tile inside one group (block_k 128) or holding two (256),
# one group for all of K, and act-order's per-row gather
SPLIT_K_QUANT = [(4, 128, False), (4, -1, False), (4, 128, True), (8, 128, False), (8, -1, False), (8, 128, True)]


@pytest.mark.parametrize("bits,group_size,act_order", SPLIT_K_QUANT)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("block_k", [128, 256])
@pytest.mark.parametrize("split_k", [2, 4])
def test_split_k_matches_reference(seed, poisoned_empty, split_k, block_k, m, bits, group_size, act_order):
    k, n = 1024, 40  # 40 columns: a partial second column tile
    gs = k if group_size == -1 else group_size
    x, qw, s, z, g_idx, _ = _random_case(m, k, n, bits, gs, act_order, torch.float32)
    y = w4a16_matmul(x, qw, s, z, group_size, g_idx, bits, tiles=Tiles(16, 32, block_k, 4, 2, split_k=split_k))
    assert y.dtype == torch.float32 and y.shape == (m, n) and y.is_contiguous()
    expected = w4a16_matmul_reference(x, qw, s, z, group_size, g_idx, bits)
    torch.testing.assert_close(y, expected, **TOL[torch.float32], msg=lambda e: f"seed={seed}: {e}")


@pytest.mark.parametrize(
    "k,group_size,split_k",
    [
        (512, 128, 4),  # slices of one 256 tile: the last two splits are empty and must add zeros
        (992, 32, 4),  # K not a tile multiple: the last slice stops at K, its last tile past K's last group
        (1024, 64, 3),  # a split that does not divide K's tiles evenly
    ],
)
def test_split_k_uneven_slices(seed, poisoned_empty, k, group_size, split_k):
    x, qw, s, z, _, q = _random_case(5, k, 24, 4, group_size, False, torch.float16)
    y = w4a16_matmul(x, qw, s, z, group_size, tiles=Tiles(16, 16, 256, 4, 2, split_k=split_k))
    assert y.dtype == torch.float16
    expected = _oracle(x, q, s, z, group_size, None)
    torch.testing.assert_close(y.cpu().double(), expected, **TOL[torch.float16], msg=lambda e: f"seed={seed}: {e}")


def test_default_decode_tiles_split_k(seed, poisoned_empty):
    x, qw, s, z, _, q = _random_case(2, 2048, 40, 4, 128, False, torch.float32)
    assert choose_tiles(2, 2048, 128, False).split_k == 2  # 16 K tiles: two slices of 8
    y = w4a16_matmul(x, qw, s, z, 128)
    torch.testing.assert_close(y.cpu().double(), _oracle(x, q, s, z, 128, None), **TOL[torch.float32])


@pytest.mark.parametrize("block_k", [256, 512])
def test_long_k_tiles(seed, poisoned_empty, block_k):
    x, qw, s, z, _, q = _random_case(3, 1024, 48, 4, 128, False, torch.float32)
    y = w4a16_matmul(x, qw, s, z, 128, tiles=Tiles(16, 64, block_k, 8, 4))
    expected = _oracle(x, q, s, z, 128, None)
    torch.testing.assert_close(y.cpu().double(), expected, **TOL[torch.float32], msg=lambda e: f"seed={seed}: {e}")


def test_tiles_for_decode_and_prefill():
    assert choose_tiles(2, 4096, 128, False) == Tiles(16, 64, 128, 4, 4, split_k=4)  # the swept fastest
    assert choose_tiles(33, 4096, 128, False).block_m == 64
    assert choose_tiles(2, 4096, 32, False).block_k == 128  # four whole groups, one scale row each
    assert choose_tiles(2, 4096, 32, True) == choose_tiles(2, 4096, 32, False)
    assert choose_tiles(512, 4096, 128, False).block_m == 128
    assert choose_tiles(512, 14336, 128, False).split_k == 1  # prefill has programs enough
    assert choose_tiles(1, 1024, 128, False).split_k == 1  # two slices would hold 4 K tiles each


def test_one_row_of_4_bit_weights_takes_the_gemv_kernel():
    """The sweep's winner at one row on an H200: gemv, 64 columns, K tile 256, 4 warps, up to 4 slices."""
    assert choose_tiles(1, 4096, 128, False) == Tiles(1, 64, 256, 4, 1, split_k=4, kind="gemv")
    assert choose_tiles(1, 14336, 128, False).split_k == 4
    assert choose_tiles(1, 2048, 128, False).split_k == 2
    assert choose_tiles(1, 896, 128, False).split_k == 1
    assert choose_tiles(1, 4096, 128, True).kind == "dot"  # act-order
    assert choose_tiles(1, 4096, 128, False, bits=8).kind == "dot"  # not measured
    assert choose_tiles(2, 4096, 128, False).kind == "dot"


@pytest.mark.parametrize("group_size", [32, 128, 96])
def test_the_default_one_row_product_matches_the_oracle(seed, poisoned_empty, group_size):
    """One row by default (the gemv kernel, K split in two): against the float64 oracle, groups
    that fill, halve or straddle the 256-deep K tile."""
    x, qw, s, z, _, q = _random_case(1, 2304, 80, 4, group_size, False, torch.float32)
    assert choose_tiles(1, 2304, group_size, False).kind == "gemv"
    y = w4a16_matmul(x, qw, s, z, group_size)
    expected = _oracle(x, q, s, z, group_size, None)
    torch.testing.assert_close(y.cpu().double(), expected, **TOL[torch.float32], msg=lambda e: f"seed={seed}: {e}")


@pytest.mark.parametrize("m,split_k", [(2, 4), (4, 4), (8, 4), (16, 2), (32, 1), (64, 1)])
def test_decode_split_shrinks_as_partial_sums_grow(m, split_k):
    t = choose_tiles(m, 4096, 128, False)
    assert t.split_k == split_k
    partial_bytes, weight_bytes = 2 * t.split_k * m * 4, 4096 // 2  # a column's, written and read / packed
    assert t.split_k == 1 or partial_bytes <= weight_bytes / 8


# Llama-3-8B's projections as the engine runs them (fused q/k/v and gate/up): (N, K), and the
# split the H200 sweep found fastest (or within 3% of it) for the tensor-core tiles at one row
LLAMA_3_8B = {"qkv": (6144, 4096, 4), "o": (4096, 4096, 4), "gate_up": (28672, 4096, 4), "down": (4096, 14336, 8)}


@pytest.mark.parametrize("proj", sorted(LLAMA_3_8B))
def test_one_row_gemv_tiles_for_llama_3_8b(proj):
    n, k, _ = LLAMA_3_8B[proj]
    t = choose_tiles(1, k, 128, False)
    assert t.kind == "gemv" and t.split_k == 4
    assert -(-n // t.block_n) * t.split_k >= 256  # about two programs per SM of 132 or more
    slice_k = k // t.split_k
    assert k % t.split_k == 0 and slice_k % t.block_k == 0 and slice_k % 128 == 0  # whole tiles, whole groups
    assert slice_k // t.block_k >= 4


@pytest.mark.parametrize("proj", sorted(LLAMA_3_8B))
def test_decode_tiles_for_llama_3_8b(proj):
    """Two rows keep the tensor-core tiles and the split the sweep found at one row."""
    n, k, swept_split = LLAMA_3_8B[proj]
    t = choose_tiles(2, k, 128, False)
    assert t.split_k == swept_split
    programs = -(-n // t.block_n) * t.split_k
    assert programs >= 256, f"{t}: {programs} programs"  # about two per SM of 132 or more
    slice_k = k // t.split_k
    assert k % t.split_k == 0 and slice_k % t.block_k == 0 and slice_k % 128 == 0  # whole tiles, whole groups
    assert slice_k // t.block_k >= 8, f"{t}: {slice_k // t.block_k} trips a slice"
    assert t.block_k // 8 * t.block_n * 4 == 4096  # packed bytes a trip, twice the 16x32 tile's


def _gemv(m, block_n, block_k, split_k=1, num_warps=4):
    return Tiles(1 << (m - 1).bit_length(), block_n, block_k, num_warps, 1, split_k=split_k, kind="gemv")


# (bits, group_size): a K tile inside one group (block_k 128) or holding two (256: each word
# gathers its group's scales), and one group for all of K
GEMV_QUANT = [(4, 128), (4, -1), (8, 128), (8, -1)]


@pytest.mark.parametrize("bits,group_size", GEMV_QUANT)
@pytest.mark.parametrize("m", range(1, GEMV_MAX_ROWS + 1))
@pytest.mark.parametrize("block_k", [128, 256])
@pytest.mark.parametrize("split_k", [1, 2, 4])
def test_gemv_matches_reference(seed, poisoned_empty, split_k, block_k, m, bits, group_size):
    k, n = 1024, 40  # 40 columns: a partial second column tile
    gs = k if group_size == -1 else group_size
    x, qw, s, z, _, _ = _random_case(m, k, n, bits, gs, False, torch.float32)
    y = w4a16_matmul(x, qw, s, z, group_size, bits=bits, tiles=_gemv(m, 32, block_k, split_k))
    assert y.dtype == torch.float32 and y.shape == (m, n) and y.is_contiguous()
    expected = w4a16_matmul_reference(x, qw, s, z, group_size, bits=bits)
    torch.testing.assert_close(y, expected, **TOL[torch.float32], msg=lambda e: f"seed={seed}: {e}")


@pytest.mark.parametrize(
    "k,group_size,block_k,split_k",
    [
        (992, 32, 128, 4),  # K not a tile multiple: the last tile runs past K's last group
        (512, 128, 256, 4),  # the last two splits are empty and must add zeros
        (1024, 96, 128, 2),  # a group size that is no power of two: tiles straddle groups
        (256, 8, 64, 1),  # groups of one word
    ],
)
def test_gemv_odd_groups_and_slices(seed, poisoned_empty, k, group_size, block_k, split_k):
    x, qw, s, z, _, q = _random_case(3, k, 24, 4, group_size, False, torch.float32)
    y = w4a16_matmul(x, qw, s, z, group_size, tiles=_gemv(3, 16, block_k, split_k))
    expected = _oracle(x, q, s, z, group_size, None)
    torch.testing.assert_close(y.cpu().double(), expected, **TOL[torch.float32], msg=lambda e: f"seed={seed}: {e}")


@pytest.mark.parametrize("bits", [4, 8])
def test_gemv_reads_strided_half_x_and_half_scales(seed, poisoned_empty, bits):
    wide = torch.randn(2, 300).half().to(DEVICE)
    x = wide[:, 8:264]  # [2, 256], row stride 300
    _, qw, s, z, _, q = _random_case(2, 256, 48, bits, 64, False, torch.float16)
    y = w4a16_matmul(x, qw, s.half(), z.half(), 64, bits=bits, tiles=_gemv(2, 16, 128, 2))
    assert y.dtype == torch.float16
    expected = _oracle(x.float(), q, s.half().float(), z.half().float(), 64, None)
    torch.testing.assert_close(y.cpu().double(), expected, **TOL[torch.float16], msg=lambda e: f"seed={seed}: {e}")


def test_gemv_block_m_may_exceed_the_rows(seed, poisoned_empty):
    x, qw, s, z, _, q = _random_case(1, 256, 32, 4, 128, False, torch.float32)
    y = w4a16_matmul(x, qw, s, z, 128, tiles=Tiles(GEMV_MAX_ROWS, 32, 128, 4, 1, kind="gemv"))
    torch.testing.assert_close(y.cpu().double(), _oracle(x, q, s, z, 128, None), **TOL[torch.float32])


def test_gemv_refuses_what_it_does_not_take():
    x, qw, s, z, g_idx, _ = _random_case(3, 128, 16, 4, 32, True, torch.float32)
    with pytest.raises(ValueError, match="a power of two from M = 3 to 4, got block_m 2"):
        w4a16_matmul(x, qw, s, z, 32, tiles=Tiles(2, 16, 64, 4, 1, kind="gemv"))
    with pytest.raises(ValueError, match="got block_m 8"):
        w4a16_matmul(x, qw, s, z, 32, tiles=Tiles(8, 16, 64, 4, 1, kind="gemv"))
    with pytest.raises(ValueError, match="g_idx"):
        w4a16_matmul(x, qw, s, z, 32, g_idx, tiles=_gemv(3, 16, 64))
    x, qw, s, z, _, _ = _random_case(1, 64, 16, 4, 4, False, torch.float32)
    with pytest.raises(ValueError, match="multiple of the 8 4-bit codes a word packs, got 4"):
        w4a16_matmul(x, qw, s, z, 4, tiles=_gemv(1, 16, 64))
    with pytest.raises(ValueError, match="tiles.kind must be one of"):
        w4a16_matmul(x, qw, s, z, 4, tiles=Tiles(16, 16, 64, 4, 2, kind="mma"))
    with pytest.raises(ValueError, match="tiles must be"):
        w4a16_matmul(x, qw, s, z, 4, tiles=Tiles(1, 16, 64, 4, 2))  # block_m 1 is gemv's alone


@given(m=st.integers(1, 1024), k_tiles=st.integers(1, 128), group_size=st.sampled_from([32, 64, 128, -1]),
       has_g_idx=st.booleans())  # fmt: skip
def test_choose_tiles_picks_gemv_for_one_row_of_4_bit_weights_alone(m, k_tiles, group_size, has_g_idx):
    k = 128 * k_tiles
    tiles = choose_tiles(m, k, k if group_size == -1 else group_size, has_g_idx)
    assert tiles.kind == ("gemv" if m == 1 and not has_g_idx else "dot")


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
    with pytest.raises(ValueError, match="split_k >= 1"):
        w4a16_matmul(x, qw, s, s, 32, tiles=Tiles(16, 16, 64, 4, 2, split_k=0))
    with pytest.raises(ValueError, match="g_idx must be int32"):
        w4a16_matmul(x, qw, s, s, 32, g_idx=torch.zeros(64, dtype=torch.int64))


@pytest.mark.parametrize("m", [1, 16, 64, 300])
@gpu_test
def test_kernel_matches_reference_on_gpu_bf16(seed, m):
    x, qw, s, z, g_idx, q = _random_case(m, 4096, 512, 4, 128, False, torch.bfloat16)
    y = w4a16_matmul(x, qw, s.bfloat16(), z.bfloat16(), 128)
    expected = w4a16_matmul_reference(x.float(), qw, s.bfloat16(), z.bfloat16(), 128)
    torch.testing.assert_close(y.float(), expected, atol=5e-2, rtol=2e-2, msg=lambda e: f"seed={seed}: {e}")
