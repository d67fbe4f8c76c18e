"""reshape_and_cache: the Triton kernel against its reference, the reference on its own."""

import pytest
import torch
from kernel_factories import DEVICE, gpu_test, huge_cache

from pagedllm.kernels import reshape_and_cache, reshape_and_cache_reference


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
