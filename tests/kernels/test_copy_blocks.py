"""copy_blocks: the Triton kernel against its reference, launch planning, the reference."""

import pytest
import torch
from kernel_factories import DEVICE, gpu_test, huge_cache

from pagedllm.kernels import copy_blocks, copy_blocks_reference
from pagedllm.kernels.copy_blocks import launch_plan


def _mapping(num_blocks: int, num_pairs: int, device=DEVICE) -> torch.Tensor:
    """Distinct blocks: sources and destinations never overlap (copy-on-write)."""
    ids = torch.randperm(num_blocks)[: 2 * num_pairs]
    return torch.stack([ids[:num_pairs], ids[num_pairs:]], dim=1).to(device)


def _assert_same(actual, expected, seed):
    for layer, (a, e) in enumerate(zip(actual, expected)):
        assert torch.equal(a, e), f"cache {layer} differs (seed={seed})"


def test_reference_copies_src_to_dst_in_every_layer():
    key_caches = [torch.arange(4.0).view(4, 1, 1, 1) + 10 * layer for layer in range(2)]
    value_caches = [-c for c in key_caches]
    copy_blocks_reference(key_caches, value_caches, torch.tensor([[0, 3], [1, 2]]))
    for layer in range(2):
        assert key_caches[layer].flatten().tolist() == [10 * layer + x for x in (0, 1, 1, 0)]
        assert value_caches[layer].flatten().tolist() == [-(10 * layer + x) for x in (0, 1, 1, 0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(16, 2, 64), (5, 3, 80), (1, 1, 96)])
def test_kernel_matches_reference_separate_layers(seed, dtype, block_size, num_kv_heads, head_dim):
    shape = (12, block_size, num_kv_heads, head_dim)
    key_caches = [torch.randn(shape, device=DEVICE).to(dtype) for _ in range(3)]
    value_caches = [torch.randn(shape, device=DEVICE).to(dtype) for _ in range(3)]
    mapping = _mapping(12, 4)
    assert len(launch_plan(key_caches, value_caches)) == 3  # one launch per layer
    expected = [c.clone() for c in key_caches + value_caches]
    copy_blocks_reference(expected[:3], expected[3:], mapping)
    copy_blocks(key_caches, value_caches, mapping)
    _assert_same(key_caches + value_caches, expected, seed)


@pytest.mark.parametrize("layout", ["layer,kv", "kv,layer"])
def test_kernel_one_launch_for_one_allocation(seed, layout):
    # [num_layers, 2, num_blocks, ...] or [2, num_layers, num_blocks, ...], views per layer
    shape = (4, 2, 10, 8, 2, 64) if layout == "layer,kv" else (2, 4, 10, 8, 2, 64)
    kv = torch.randn(shape, device=DEVICE)
    key_caches = [kv[layer, 0] if layout == "layer,kv" else kv[0, layer] for layer in range(4)]
    value_caches = [kv[layer, 1] if layout == "layer,kv" else kv[1, layer] for layer in range(4)]
    assert len(launch_plan(key_caches, value_caches)) == 1
    mapping = _mapping(10, 3)
    expected = kv.clone()
    copy_blocks_reference(
        [expected[i, 0] if layout == "layer,kv" else expected[0, i] for i in range(4)],
        [expected[i, 1] if layout == "layer,kv" else expected[1, i] for i in range(4)],
        mapping,
    )
    copy_blocks(key_caches, value_caches, mapping)
    assert torch.equal(kv, expected), f"seed={seed}"


def test_kernel_block_offsets_past_int32(seed):
    # [num_blocks, 2, block_size, 1, head_dim]: K and V blocks interleaved, so
    # block_id * stride(0) passes 2**31 for block ids >= 2**20
    num_blocks = 2**20 + 8
    fused = huge_cache((num_blocks, 2, 16, 64), torch.float16).unsqueeze(3)
    key_cache, value_cache = fused[:, 0], fused[:, 1]
    mapping = torch.tensor([[3, 2**20 + 7], [2**20 + 1, 5], [2**20 + 2, 2**20 + 4]], device=DEVICE)
    for block in mapping[:, 0]:
        key_cache[block].normal_()
        value_cache[block].normal_()
    sources = key_cache[mapping[:, 0]].clone(), value_cache[mapping[:, 0]].clone()
    copy_blocks([key_cache], [value_cache], mapping)
    assert torch.equal(key_cache[mapping[:, 1]], sources[0]), f"seed={seed}"
    assert torch.equal(value_cache[mapping[:, 1]], sources[1]), f"seed={seed}"


def test_launcher_rejects_bad_arguments():
    caches = [torch.zeros(4, 2, 1, 64)]
    with pytest.raises(ValueError, match="block_mapping must be int64"):
        copy_blocks(caches, caches, torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="2 value caches"):
        copy_blocks(caches, caches * 2, torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous within a block"):
        strided = torch.zeros(4, 2, 2, 64)[:, :, :1]
        copy_blocks([strided], [strided], torch.tensor([[0, 1]], device=strided.device))


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_matches_reference_cuda(seed, dtype):
    shape = (64, 16, 8, 128)
    key_caches = [torch.randn(shape, device="cuda").to(dtype) for _ in range(4)]
    value_caches = [torch.randn(shape, device="cuda").to(dtype) for _ in range(4)]
    mapping = _mapping(64, 20, device="cuda")
    expected = [c.clone() for c in key_caches + value_caches]
    copy_blocks_reference(expected[:4], expected[4:], mapping)
    copy_blocks(key_caches, value_caches, mapping)
    _assert_same(key_caches + value_caches, expected, seed)
