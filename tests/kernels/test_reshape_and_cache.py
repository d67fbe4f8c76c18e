"""reshape_and_cache: the Triton kernel against its reference, the reference on its own; into an
8-bit cache, the quantized bytes against the reference's and the values against float64."""

import pytest
import torch
from kernel_factories import DEVICE, gpu_test, huge_cache

from pagedllm.kernels import reshape_and_cache, reshape_and_cache_reference
from pagedllm.kernels.kv_quant import QUANT_DTYPES, dequantize, raw, row_width


def _random_case(num_tokens, num_kv_heads, head_dim, block_size, num_blocks, dtype, device=DEVICE):
    """Fresh K/V as strided views of a fused QKV output, distinct slots, some padding."""
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim + 8, device=device).to(dtype)
    width = num_kv_heads * head_dim
    key = qkv[:, width : 2 * width].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 2 * width : 3 * width].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens].to(device)
    slots[torch.rand(num_tokens, device=device) < 0.25] = -1  # padding tokens
    slots[0] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype)
    return key, value, caches, slots


def test_reference_writes_exactly_the_slots():
    key = torch.arange(3 * 2 * 4, dtype=torch.float32).view(3, 2, 4)
    value = -key
    key_cache = torch.zeros(4, 2, 2, 4)
    value_cache = torch.zeros(4, 2, 2, 4)
    slot_mapping = torch.tensor([5, -1, 0])  # block 2 offset 1; padding; block 0 offset 0
    reshape_and_cache_reference(key, value, key_cache, value_cache, slot_mapping)
    expected = torch.zeros(4, 2, 2, 4)
    expected[2, 1], expected[0, 0] = key[0], key[2]
    assert torch.equal(key_cache, expected)
    assert torch.equal(value_cache, -expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(1, 64, 1), (2, 80, 16), (8, 96, 5), (4, 128, 32)])
def test_kernel_matches_reference(seed, dtype, num_kv_heads, head_dim, block_size):
    num_blocks = 30 // block_size + 2
    key, value, (key_cache, value_cache), slots = _random_case(
        23, num_kv_heads, head_dim, block_size, num_blocks, dtype
    )
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache_reference(key, value, expected_k, expected_v, slots)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k), f"seed={seed}"
    assert torch.equal(value_cache, expected_v), f"seed={seed}"


def test_kernel_block_offsets_past_int32(seed):
    # [num_blocks, block_size, 2, head_dim]: K in slot 0, V in slot 1 of each position, so
    # block_id * stride(0) passes 2**31 for block ids >= 2**20.
    num_blocks, block_size, head_dim = 2**20 + 8, 16, 64
    fused = huge_cache((num_blocks, block_size, 2, head_dim), torch.float16)
    key_cache, value_cache = fused[:, :, 0:1], fused[:, :, 1:2]
    blocks = torch.tensor([num_blocks - 1, 2**20, 3, num_blocks - 1])
    offsets = torch.tensor([15, 0, 7, 2])
    slots = (blocks * block_size + offsets).to(DEVICE)
    key = torch.randn(4, 1, head_dim, device=DEVICE).half()
    value = torch.randn(4, 1, head_dim, device=DEVICE).half()
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache[blocks, offsets], key), f"seed={seed}"
    assert torch.equal(value_cache[blocks, offsets], value), f"seed={seed}"


def test_launcher_rejects_bad_arguments():
    key = torch.randn(3, 2, 64)
    cache = torch.zeros(4, 8, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        reshape_and_cache(key, key, cache, cache, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="num_kv_heads, head_dim"):
        reshape_and_cache(torch.randn(3, 4, 64), torch.randn(3, 4, 64), cache, cache, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="dtype"):
        reshape_and_cache(key.half(), key.half(), cache, cache, torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(8, 128, 16), (2, 80, 128), (32, 64, 256)])
@gpu_test
def test_kernel_matches_reference_cuda(seed, dtype, num_kv_heads, head_dim, block_size):
    key, value, (key_cache, value_cache), slots = _random_case(
        300, num_kv_heads, head_dim, block_size, 40, dtype, device="cuda"
    )
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache_reference(key, value, expected_k, expected_v, slots)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v), f"seed={seed}"


# --- an 8-bit cache: the kernel quantizes the rows it writes ---------------------------------

QDTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in QUANT_DTYPES]
SCALES = {torch.float8_e4m3fn: (0.37, 1.0), torch.float8_e5m2: (3.1, 0.011), torch.int8: (1.0, 1.0)}


def _wide_rows(tokens, heads, head_dim, dtype, device, strided):
    """Rows of very different sizes (1e-9 .. 1e5), exact zeros, a zero row, values past fp8's range."""
    size = torch.logspace(-9, 5, tokens * heads, device=device)[torch.randperm(tokens * heads, device=device)]
    x = torch.randn(tokens, 2 * heads if strided else heads, head_dim, device=device)
    x = (x[:, ::2] if strided else x) * size.view(tokens, heads, 1)
    x[x.abs() < 0.05 * x.abs().amax(-1, keepdim=True)] = 0.0
    x[0, 0] = 0.0
    if dtype == torch.float16:  # NOTE: float16 holds neither 1e5 nor 1e-9: keep its range
        x = x.clamp(-6e4, 6e4)
    return x.to(dtype)


def _quantized_case(tokens, heads, head_dim, block_size, qdtype, in_dtype, device=DEVICE, strided=False):
    """Fresh K/V, distinct slots with padding (-1), and two caches whose every byte is random."""
    key = _wide_rows(tokens, heads, head_dim, in_dtype, device, strided)
    value = _wide_rows(tokens, heads, head_dim, in_dtype, device, strided)
    num_blocks = tokens // block_size + 3
    slots = torch.randperm(num_blocks * block_size)[:tokens].to(device)
    slots[torch.rand(tokens, device=device) < 0.25] = -1
    slots[0] = -1
    shape = (num_blocks, block_size, heads, row_width(qdtype, head_dim))
    caches = [torch.randint(0, 256, shape, dtype=torch.uint8, device=device).view(qdtype) for _ in range(2)]
    return key, value, caches, slots


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    return raw(cache).view(torch.uint8).cpu()


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,heads,head_dim,block_size", [(1, 1, 64, 1), (11, 3, 40, 4), (7, 8, 128, 16)])
@pytest.mark.parametrize("strided", [False, True])
def test_quantizing_kernel_writes_the_references_bytes(
    seed, qdtype, in_dtype, tokens, heads, head_dim, block_size, strided
):
    key, value, caches, slots = _quantized_case(tokens, heads, head_dim, block_size, qdtype, in_dtype, strided=strided)
    before = [_bytes(c).clone() for c in caches]
    want = [c.cpu().clone() for c in caches]
    k_scale, v_scale = SCALES[qdtype]
    reshape_and_cache_reference(key.cpu(), value.cpu(), *want, slots.cpu(), k_scale, v_scale)
    reshape_and_cache(key, value, *caches, slots, k_scale, v_scale)
    written = slots[slots >= 0].cpu()
    for got, w, old in zip(caches, want, before):
        assert torch.equal(_bytes(got), _bytes(w)), f"seed={seed}"  # the written rows, every other byte kept
        untouched = torch.ones(old.shape[0] * old.shape[1], dtype=torch.bool)
        untouched[written] = False
        assert torch.equal(_bytes(got).flatten(0, 1)[untouched], old.flatten(0, 1)[untouched]), f"seed={seed}"


def _fp8_grid(qdtype: torch.dtype) -> torch.Tensor:
    """Every finite value of an fp8 format, float64."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(qdtype).double()
    return values[torch.isfinite(values)]


def _check_fp8_rows(got, x, scale, qdtype, seed):
    """Each dequantized value (over ``scale``) is a nearest fp8 value to ``x / scale`` clamped to the format."""
    y = (x.double() / scale).clamp(-torch.finfo(qdtype).max, torch.finfo(qdtype).max)
    assert torch.isfinite(got).all(), f"seed={seed}"
    best = (_fp8_grid(qdtype)[None, :] - y.reshape(-1, 1)).abs().amin(1).view(y.shape)
    # NOTE: x / scale is rounded to float32 first, which may turn a near-tie into a tie
    assert ((got - y).abs() <= best + y.abs() * 2.0**-22).all(), f"seed={seed}"


def _check_int8_rows(rows, x, seed):
    """Each row's scale is max|x| / 127 within a float16 step above, each value x / r to the nearest integer."""
    q, r = rows[..., :-2].double(), rows[..., -2:].contiguous().view(torch.float16).double()
    amax = x.double().abs().amax(-1, keepdim=True)
    exact = (amax / 127).clamp(min=2.0**-24)
    assert (r >= exact).all() and (r <= exact * (1 + 2.0**-9) + 2.0**-24).all(), f"seed={seed}"
    assert (q.abs() <= 127).all(), f"seed={seed}"
    assert ((q - x.double() / r).abs() <= 0.5 + 2.0**-16).all(), f"seed={seed}"  # float32's x / r: near ties


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16])
def test_quantized_rows_are_a_float64_quantization_of_the_inputs(seed, qdtype, in_dtype):
    key, value, caches, slots = _quantized_case(13, 2, 48, 8, qdtype, in_dtype)
    k_scale, v_scale = SCALES[qdtype]
    reshape_and_cache(key, value, *caches, slots, k_scale, v_scale)
    valid = slots >= 0
    for cache, x, scale in zip(caches, (key, value), (k_scale, v_scale)):
        rows = cache.flatten(0, 1)[slots[valid]].cpu()  # [num_valid, heads, row]
        if qdtype == torch.int8:
            _check_int8_rows(rows, x[valid].cpu(), seed)
        else:
            _check_fp8_rows(dequantize(rows, torch.float64, scale) / scale, x[valid].cpu(), scale, qdtype, seed)


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_every_rounding_tie_matches_the_reference(qdtype):
    """Values at and around every float16 / fp8 rounding tie, subnormals, and rows whose scale lies on a tie."""
    g = torch.Generator().manual_seed(11)
    ties = torch.arange(0, 2**16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    ties = ties[torch.isfinite(ties)]
    near = torch.cat([ties, ties.nextafter(ties * 2 + 1), (ties[1:] + ties[:-1]) / 2]).clamp(-6e4, 6e4)
    mids = (ties[1:] + ties[:-1])[ties[1:] > 0] / 2
    mids = mids[:: max(1, mids.numel() // 512)]
    rows = torch.rand(mids.numel(), 64, generator=g) * 127 * mids[:, None]
    rows[:, 0] = -127 * mids
    x = torch.cat([near[: near.numel() // 64 * 64].view(-1, 64), rows])
    x = x[torch.randperm(x.shape[0], generator=g)][: x.shape[0] // 32 * 32].view(-1, 32, 64)  # 32 heads a program
    slots = torch.arange(x.shape[0])
    for scale in (1.0, 0.013, 7.0):
        want = [torch.zeros(x.shape[0], 1, 32, row_width(qdtype, 64), dtype=qdtype) for _ in range(2)]
        got = [c.to(DEVICE) for c in want]
        reshape_and_cache(x.to(DEVICE), -x.to(DEVICE), *got, slots.to(DEVICE), scale, scale)
        reshape_and_cache_reference(x, -x, *want, slots, scale, scale)
        for g_, w in zip(got, want):
            assert torch.equal(_bytes(g_), _bytes(w)), f"scale={scale}"


def test_launcher_rejects_what_an_8bit_cache_cannot_hold():
    key, slots = torch.randn(3, 2, 64), torch.zeros(3, dtype=torch.int64)
    cache = torch.zeros(4, 8, 2, row_width(torch.int8, 64), dtype=torch.int8)
    narrow = torch.zeros(4, 8, 2, 64, dtype=torch.int8)  # an int8 row is head_dim + 2 wide: this holds 62
    with pytest.raises(ValueError, match=r"the cache holds \(num_kv_heads, head_dim\) = \(2, 62\)"):
        reshape_and_cache(key, key, narrow, narrow.clone(), slots)
    with pytest.raises(ValueError, match=r"the cache holds .* = \(2, 64\)"):
        reshape_and_cache(torch.randn(3, 2, 66), torch.randn(3, 2, 66), cache, cache, slots)
    with pytest.raises(TypeError, match="quantizes one of"):
        reshape_and_cache(key.double(), key.double(), cache, cache, slots)
    with pytest.raises(TypeError, match="pairs"):
        reshape_and_cache(key, key.half(), cache, cache, slots)


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("in_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,head_dim,block_size", [(8, 128, 16), (2, 80, 128), (32, 64, 256)])
@gpu_test
def test_quantizing_kernel_writes_the_references_bytes_cuda(seed, qdtype, in_dtype, heads, head_dim, block_size):
    key, value, caches, slots = _quantized_case(300, heads, head_dim, block_size, qdtype, in_dtype, device="cuda")
    want = [c.cpu().clone() for c in caches]
    k_scale, v_scale = SCALES[qdtype]
    # NOTE: the reference runs on the CPU: torch on CUDA multiplies by a Python divisor's reciprocal
    reshape_and_cache_reference(key.cpu(), value.cpu(), *want, slots.cpu(), k_scale, v_scale)
    reshape_and_cache(key, value, *caches, slots, k_scale, v_scale)
    for got, w in zip(caches, want):
        assert torch.equal(_bytes(got), _bytes(w)), f"seed={seed}"
