"""paged_prefill_attention: reference vs a naive dense oracle, Triton kernel vs reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_factories import DEVICE, assert_close, gpu_test, huge_cache, make_paged_kv, naive_attention

from pagedllm.kernels import (
    paged_decode_attention_reference,
    paged_prefill_attention,
    paged_prefill_attention_reference,
)
from pagedllm.kernels.paged_prefill_attention import paged_prefill_attention_launch


def _case(lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device=DEVICE, window=None, **kv_kwargs):
    """Sequences of ``lens`` tokens whose last ``q_lens`` are new (already in the cache).

    With a ``window`` the blocks before the first new token's window are garbage in the
    table and NaN in the cache (freed), so reading them shows."""
    if window is not None:
        kv_kwargs["visible_from"] = [max(0, n - q + 1 - window) for n, q in zip(lens, q_lens)]
    kv = make_paged_kv(lens, num_kv_heads, head_dim, block_size, dtype, device=device, **kv_kwargs)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    query = torch.randn(int(cu[-1]), num_heads, head_dim, device=device).to(dtype)
    key = torch.cat([k[len(k) - q :] for k, q in zip(kv.keys, q_lens)])
    value = torch.cat([v[len(v) - q :] for v, q in zip(kv.values, q_lens)])
    args = (query, key, value, kv.key_cache, kv.value_cache, kv.block_tables, cu, kv.context_lens, head_dim**-0.5)
    return args, kv


@st.composite
def _seqs(draw):
    lens = draw(st.lists(st.integers(0, 40), min_size=1, max_size=4))
    q_lens = [draw(st.integers(0, n)) for n in lens]
    return lens, q_lens


@settings(max_examples=25, deadline=None)
@given(
    seqs=_seqs(),
    block_size=st.sampled_from([1, 4, 16]),
    heads=st.sampled_from([(2, 2), (4, 1), (8, 2), (6, 3)]),
    window=st.one_of(st.none(), st.just(1), st.integers(1, 45)),
    softcap=st.sampled_from([None, 0.5, 5.0, 50.0]),
)
def test_reference_matches_naive_attention(seqs, block_size, heads, window, softcap):
    lens, q_lens = seqs
    args, kv = _case(lens, q_lens, *heads, 16, block_size, torch.float32, device="cpu", window=window)
    query, cu, scale = args[0], args[6], args[8]
    out = paged_prefill_attention_reference(*args, window, softcap)
    expected = torch.cat(
        [
            naive_attention(query[cu[s] : cu[s + 1]], kv.keys[s], kv.values[s], scale, window, softcap)
            for s in range(len(lens))
        ]
    )
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (1, 2.0), (12, 30.0)])
def test_reference_with_one_new_token_equals_decode_reference(window, softcap):
    args, kv = _case([1, 9, 33], [1, 1, 1], 8, 2, 64, 8, torch.float32, device="cpu", window=window)
    decode = paged_decode_attention_reference(
        args[0], kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, args[8], window, softcap
    )
    torch.testing.assert_close(paged_prefill_attention_reference(*args, window, softcap), decode)


# (lens, q_lens): pure prefill, prefix + extension, single tokens, an empty sequence, and
# lengths around block and tile boundaries
CASES = [
    ([37], [37]),
    ([20, 45, 1, 16, 17], [5, 45, 1, 3, 17]),
    ([15, 0, 33, 64], [15, 0, 1, 30]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "case,heads,head_dim,block_size,block_m",
    [
        (CASES[0], (4, 4), 64, 16, 16),
        (CASES[1], (4, 2), 80, 8, 32),
        (CASES[2], (8, 2), 96, 16, 16),
        (CASES[1], (16, 2), 128, 3, 16),
        (CASES[2], (8, 1), 64, 32, 64),
        (CASES[0], (6, 2), 80, 1, 16),
    ],
)
def test_kernel_matches_reference(seed, dtype, case, heads, head_dim, block_size, block_m):
    args, _ = _case(*case, *heads, head_dim, block_size, dtype)
    out = paged_prefill_attention_launch(*args, block_m=block_m)
    assert out.dtype == dtype and out.shape == args[0].shape
    assert_close(out, paged_prefill_attention_reference(*args), seed)


# (lens, q_lens, window, softcap, block_size, block_m): windows shorter than, equal to and
# longer than the contexts, window 1, non-multiples of the block size, chunks after a prefix
WINDOW_CASES = [
    ([37], [37], 8, None, 8, 16),
    ([20, 45, 1, 16, 17], [5, 45, 1, 3, 17], 1, None, 4, 16),
    ([15, 0, 33, 64], [15, 0, 1, 30], 13, 5.0, 8, 32),
    ([40, 40], [40, 7], 40, 0.5, 16, 16),
    ([50, 29], [20, 29], 100, 30.0, 5, 16),
    ([33, 18], [10, 18], None, 2.0, 16, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lens,q_lens,window,softcap,block_size,block_m", WINDOW_CASES)
def test_kernel_with_window_and_softcap_matches_reference(
    seed, dtype, lens, q_lens, window, softcap, block_size, block_m
):
    args, _ = _case(lens, q_lens, 8, 2, 32, block_size, dtype, window=window)
    out = paged_prefill_attention_launch(*args, window, softcap, block_m=block_m)
    assert_close(out, paged_prefill_attention_reference(*args, window, softcap), seed)


def test_public_function_accepts_no_key_value(seed):
    args, _ = _case([30, 12], [30, 4], 4, 2, 64, 16, torch.float16)
    args = (args[0], None, None, *args[3:])
    assert_close(paged_prefill_attention(*args), paged_prefill_attention_reference(*args), seed)


def test_kernel_block_offsets_past_int32(seed):
    # fused [num_blocks, block_size, 2, head_dim] cache: block ids >= 2**20 overflow int32
    num_blocks, block_size, head_dim = 2**20 + 8, 16, 64
    fused = huge_cache((num_blocks, block_size, 2, head_dim), torch.float16)
    block_ids = torch.tensor([2**20 + 7, 3, 2**20, 2**20 + 3, 11, 2**20 + 5])
    args, _ = _case(
        [33, 40],
        [10, 40],
        4,
        1,
        head_dim,
        block_size,
        torch.float16,
        caches=(fused[:, :, 0:1], fused[:, :, 1:2]),
        block_ids=block_ids,
    )
    assert_close(paged_prefill_attention_launch(*args, block_m=16), paged_prefill_attention_reference(*args), seed)


def test_launcher_rejects_bad_arguments():
    args, _ = _case([5], [5], 4, 2, 64, 8, torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens_q must be"):
        paged_prefill_attention(*args[:6], args[6].long(), *args[7:])
    with pytest.raises(ValueError, match="key must be"):
        paged_prefill_attention(args[0], args[1][:, :1], *args[2:])
    for fn in (paged_prefill_attention, paged_prefill_attention_reference):
        with pytest.raises(ValueError, match="sliding_window must be >= 1"):
            fn(*args, sliding_window=0)
        with pytest.raises(ValueError, match="logit_softcap must be > 0"):
            fn(*args, logit_softcap=0.0)


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,head_dim,block_size", [((32, 8), 128, 16), ((32, 32), 128, 128), ((8, 1), 80, 8), ((12, 4), 96, 32)]
)
@pytest.mark.parametrize("window,softcap", [(None, None), (1000, None), (37, 50.0)])
def test_kernel_matches_reference_cuda(seed, dtype, heads, head_dim, block_size, window, softcap):
    lens, q_lens = [700, 1, 129, 2048, 300, 0], [700, 1, 64, 512, 1, 0]
    args, _ = _case(lens, q_lens, *heads, head_dim, block_size, dtype, device="cuda", window=window)
    out = paged_prefill_attention(*args, window, softcap)
    assert_close(out, paged_prefill_attention_reference(*args, window, softcap), seed)
