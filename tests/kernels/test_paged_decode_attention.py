"""paged_decode_attention: reference vs a naive dense oracle, Triton kernel vs reference."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_factories import DEVICE, assert_close, gpu_test, huge_cache, make_paged_kv, naive_attention

from pagedllm.kernels import paged_decode_attention, paged_decode_attention_reference
from pagedllm.kernels.paged_decode_attention import (
    COUNTERS_MIN,
    MAX_SPLITS,
    choose_num_splits,
    paged_decode_attention_launch,
    split_counters,
)


def _lens(block_size: int) -> list[int]:
    """Lengths around block boundaries: 1, bs-1, bs, bs+1 and a longer one."""
    return sorted({1, max(1, block_size - 1), block_size, block_size + 1, 3 * block_size + 5})


def _case(lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device=DEVICE, window=None):
    """With a ``window`` the blocks before each query's window are garbage in the table (freed)."""
    visible_from = None if window is None else [max(0, n - window) for n in lens]
    kv = make_paged_kv(lens, num_kv_heads, head_dim, block_size, dtype, device=device, visible_from=visible_from)
    query = torch.randn(len(lens), num_heads, head_dim, device=device).to(dtype)
    return query, kv


def _naive(query, kv, scale, window=None, softcap=None):
    return torch.cat(
        [
            naive_attention(query[s : s + 1], kv.keys[s], kv.values[s], scale, window, softcap)
            for s in range(len(kv.keys))
        ]
    )


# a window: none, one position, or any size (smaller than, equal to or larger than the
# context, a multiple of the block size or not); soft-capping off or on
WINDOWS = st.one_of(st.none(), st.just(1), st.integers(1, 80))
SOFTCAPS = st.sampled_from([None, 0.5, 5.0, 50.0])


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(0, 70), min_size=1, max_size=5),
    block_size=st.sampled_from([1, 3, 8, 16, 32]),
    heads=st.sampled_from([(1, 1), (4, 4), (4, 2), (6, 2), (8, 1), (16, 2)]),
    head_dim=st.sampled_from([8, 80]),
    window=WINDOWS,
    softcap=SOFTCAPS,
)
def test_reference_matches_naive_attention(lens, block_size, heads, head_dim, window, softcap):
    query, kv = _case(lens, *heads, head_dim, block_size, torch.float32, device="cpu", window=window)
    scale = head_dim**-0.5
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, scale)
    out = paged_decode_attention_reference(*args, sliding_window=window, logit_softcap=softcap)
    torch.testing.assert_close(out.double(), _naive(query, kv, scale, window, softcap), atol=1e-5, rtol=1e-5)


def test_window_and_softcap_change_the_reference():
    """The oracle's knobs are live: a window shorter than the context and a small cap both
    change the output, a window as long as the context does not."""
    query, kv = _case([40, 25], 4, 2, 16, 8, torch.float32, device="cpu")
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 0.25)
    full = paged_decode_attention_reference(*args)
    assert torch.equal(paged_decode_attention_reference(*args, sliding_window=40), full)
    windowed = paged_decode_attention_reference(*args, sliding_window=10)
    assert (windowed - full).abs().amax(dim=(1, 2)).min() > 1e-3
    capped = paged_decode_attention_reference(*args, logit_softcap=0.5)
    assert (capped - full).abs().amax(dim=(1, 2)).min() > 1e-3


def test_reference_returns_zeros_for_empty_context():
    query, kv = _case([0, 5], 4, 2, 64, 4, torch.float32, device="cpu")
    out = paged_decode_attention_reference(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert not out.isnan().any()


# (num_heads, num_kv_heads): GQA ratios 1, 2, 4, 8, MQA, and a non-power-of-two group
HEADS = [(4, 4), (4, 2), (8, 2), (16, 2), (8, 1), (6, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "heads,head_dim,block_size,num_splits",
    [
        (HEADS[0], 64, 16, 1),
        (HEADS[1], 80, 8, 4),
        (HEADS[2], 96, 16, 3),
        (HEADS[3], 128, 32, 2),
        (HEADS[4], 64, 5, None),
        (HEADS[5], 80, 1, 4),
    ],
)
def test_kernel_matches_reference(seed, dtype, heads, head_dim, block_size, num_splits):
    query, kv = _case(_lens(block_size), *heads, head_dim, block_size, dtype)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, head_dim**-0.5)
    out = paged_decode_attention_launch(*args, num_splits=num_splits)
    assert out.dtype == dtype and out.shape == query.shape
    assert_close(out, paged_decode_attention_reference(*args), seed)


# (lens, window, softcap, block_size, num_splits): windows shorter than, equal to and longer
# than the contexts, window 1, windows that are and are not block multiples, several splits
WINDOW_CASES = [
    ([1, 7, 8, 9, 40], 8, None, 8, 4),
    ([1, 5, 30, 41], 1, None, 4, 2),
    ([3, 17, 33, 50], 13, 5.0, 8, 3),
    ([20, 21, 64], 21, 0.5, 16, 1),
    ([2, 33, 70], 100, 30.0, 5, 4),
    ([9, 66], None, 2.0, 16, 2),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lens,window,softcap,block_size,num_splits", WINDOW_CASES)
def test_kernel_with_window_and_softcap_matches_reference(seed, dtype, lens, window, softcap, block_size, num_splits):
    """Blocks before each window are garbage in the table and NaN in the cache: the kernel must not read them."""
    query, kv = _case(lens, 8, 2, 32, block_size, dtype, window=window)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 32**-0.5, window, softcap)
    out = paged_decode_attention_launch(*args, num_splits=num_splits)
    assert_close(out, paged_decode_attention_reference(*args), seed)


def test_public_function_matches_reference(seed):
    query, kv = _case([1, 40, 77], 8, 2, 64, 16, torch.float16)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 0.125)
    assert_close(paged_decode_attention(*args), paged_decode_attention_reference(*args), seed)


def test_empty_splits_and_empty_context_give_no_nan(seed):
    # 8 splits over contexts of 0, 1 and 17 tokens with 16-token tiles: most splits are empty
    query, kv = _case([0, 1, 17], 4, 2, 64, 16, torch.float32)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 0.125)
    out = paged_decode_attention_launch(*args, num_splits=8, block_n=16)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_close(out, paged_decode_attention_reference(*args), seed)


def test_tile_larger_than_block_and_block_larger_than_tile(seed):
    for block_size, block_n in [(4, 32), (64, 16)]:
        query, kv = _case([3, 70, 129], 4, 1, 64, block_size, torch.float32)
        args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 0.125)
        out = paged_decode_attention_launch(*args, num_splits=2, block_n=block_n)
        assert_close(out, paged_decode_attention_reference(*args), seed)


def test_kernel_block_offsets_past_int32(seed):
    # fused [num_blocks, block_size, 2, head_dim] cache: block_id * stride(0) passes 2**31
    # for block ids >= 2**20; the sequences' blocks sit on both sides of that line.
    num_blocks, block_size, head_dim = 2**20 + 8, 16, 64
    fused = huge_cache((num_blocks, block_size, 2, head_dim), torch.float16)
    caches = fused[:, :, 0:1], fused[:, :, 1:2]
    block_ids = torch.tensor([2**20 + 7, 3, 2**20, 2**20 + 3, 11, 2**20 + 5])
    kv = make_paged_kv([33, 40], 1, head_dim, block_size, torch.float16, caches=caches, block_ids=block_ids)
    query = torch.randn(2, 4, head_dim, device=DEVICE).half()
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 0.125)
    out = paged_decode_attention_launch(*args, num_splits=2)
    assert_close(out, paged_decode_attention_reference(*args), seed)


def test_num_splits_heuristic():
    # a full GPU's worth of programs: no split
    assert choose_num_splits(256, 8, 8192, 64, num_sms=132) == 1
    # one sequence, long context: split up to the cap, a power of two
    splits = choose_num_splits(1, 8, 8192, 64, num_sms=132)
    assert 1 < splits <= MAX_SPLITS and splits & (splits - 1) == 0
    assert 8192 // splits >= 256
    # short context: splitting does not pay
    assert choose_num_splits(1, 8, 300, 64, num_sms=132) == 1


def test_launcher_rejects_bad_arguments():
    query, kv = _case([5], 4, 2, 64, 8, torch.float32)
    args = [query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 0.1]
    for fn in (paged_decode_attention, paged_decode_attention_reference):
        with pytest.raises(ValueError, match="sliding_window must be >= 1"):
            fn(*args, sliding_window=0)
        with pytest.raises(ValueError, match="logit_softcap must be > 0"):
            fn(*args, logit_softcap=0.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(torch.randn(1, 3, 64, device=DEVICE), *args[1:])
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_decode_attention(*args[:3], kv.block_tables.long(), *args[4:])
    with pytest.raises(ValueError, match="context_lens must be"):
        paged_decode_attention(*args[:4], kv.context_lens.long(), args[5])
    with pytest.raises(TypeError, match="dtype"):
        paged_decode_attention(query.half(), *args[1:])


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,head_dim,block_size", [((32, 8), 128, 16), ((32, 32), 128, 128), ((8, 1), 80, 8), ((12, 4), 96, 32)]
)
@pytest.mark.parametrize("num_splits", [None, 1, 5])
@pytest.mark.parametrize("window,softcap", [(None, None), (1000, None), (37, 50.0)])
def test_kernel_matches_reference_cuda(seed, dtype, heads, head_dim, block_size, num_splits, window, softcap):
    lens = [1, block_size - 1 or 1, block_size, block_size + 1, 1000, 4097, 0]
    query, kv = _case(lens, *heads, head_dim, block_size, dtype, device="cuda", window=window)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 1 / math.sqrt(head_dim))
    out = paged_decode_attention_launch(*args, window, softcap, num_splits=num_splits)
    assert_close(out, paged_decode_attention_reference(*args, window, softcap), seed)


def _poisoned_outputs(monkeypatch):
    """Every buffer the launcher allocates starts as NaN: an element it never writes shows."""
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: empty_like(*a, **k).fill_(float("nan")))


def _launches(monkeypatch) -> list[str]:
    """Names of the Triton kernels launched from now on (the interpreter's launch path)."""
    from triton.runtime.interpreter import InterpretedFunction

    names, run = [], InterpretedFunction.run

    def counted(kernel, *args, **kwargs):
        names.append(kernel.__name__)
        return run(kernel, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counted)
    return names


# batch 1 over long contexts (many tiles per split), the merge with empty splits (64 splits
# over 300 tokens), and a batch whose sequences all split
BATCH_ONE_CASES = [([1500], 16, 4), ([2049], 32, 8), ([300], 16, 64), ([1, 700, 1200], 8, 16)]


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's launch path")
@pytest.mark.parametrize("lens,block_size,num_splits", BATCH_ONE_CASES)
def test_split_kv_merges_in_the_same_launch(seed, monkeypatch, lens, block_size, num_splits):
    query, kv = _case(lens, 8, 2, 64, block_size, torch.float32)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 0.125)
    _poisoned_outputs(monkeypatch)
    launched = _launches(monkeypatch)
    out = paged_decode_attention_launch(*args, num_splits=num_splits, block_n=16 if lens[0] < 2000 else 64)
    assert launched == ["paged_decode_attention_kernel"]  # one launch, the merge included
    assert_close(out, _naive(query, kv, 0.125).float(), seed)  # against the float64 oracle
    counters = split_counters(query.device, 1)
    assert not counters.any()  # left zeroed for the next launch (or graph replay)
    again = paged_decode_attention_launch(*args, num_splits=num_splits, block_n=16)
    assert_close(again, out, seed)


def test_split_counters_grow_and_stay_zeroed():
    device = torch.device("cpu")
    small = split_counters(device, 3)
    assert small.dtype == torch.int32 and small.numel() >= 1024 and not small.any()
    assert split_counters(device, 10) is small  # NOTE: kept: graph replays read its address
    big = split_counters(device, 5000)
    assert big.numel() == 8192 and not big.any() and split_counters(device, 7) is big


def test_batch_one_with_a_long_context_splits_for_enough_programs():
    # one sequence of 32k tokens on 132 multiprocessors: the cap; 8 sequences of 4k: fewer, >= 256 tokens each
    assert choose_num_splits(1, 8, 32768, 64, num_sms=132) == MAX_SPLITS
    assert choose_num_splits(8, 8, 4096, 64, num_sms=132) == 8
    # NOTE: only batches of fewer than 4 programs per multiprocessor split, so the counters never grow on a GPU
    for num_sms in (132, 256):
        for seqs in (1, 3, 64, 127, 128, 129, 300, 1024):
            for kv_heads in (1, 2, 8, 32):
                if choose_num_splits(seqs, kv_heads, 1 << 20, 64, num_sms=num_sms) > 1:
                    assert seqs * kv_heads <= COUNTERS_MIN
