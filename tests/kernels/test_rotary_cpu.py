"""The compiled in-place rotary embedding against its torch reference: bitwise equal."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.paged_decode_attention_cpu import HAS_NUMBA
from pagedllm.kernels.rotary_cpu import rotary_cpu_, rotary_reference
from pagedllm.server.worker.models.rope import rotation_table
from tests.kernels.kernel_factories import torch_threads

pytestmark = pytest.mark.skipif(not HAS_NUMBA, reason="numba is not installed")


@pytest.mark.parametrize("tokens,heads,head_dim,partial", [(1, 4, 16, None), (16, 8, 64, None), (45, 2, 32, 0.5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
def test_in_place_equals_reference(tokens, heads, head_dim, partial, dtype, table_dtype):
    params = {"rope_type": "default", "rope_theta": 10000.0}
    if partial is not None:
        params["partial_rotary_factor"] = partial
    cos, sin = (t.to(table_dtype) for t in rotation_table(head_dim, 512, params))
    g = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, heads * head_dim, generator=g) * 3).to(dtype)
    positions = torch.randint(0, 512, (tokens,), generator=g)
    want = rotary_reference(x, cos, sin, positions, head_dim)
    got = rotary_cpu_(x, cos, sin, positions, head_dim)
    assert got is x  # rotated in place
    # NOTE: bitwise in bfloat16 too: each product, then their sum, is rounded to bf16 as torch's ops do
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_size_spread_over_threads(dtype, threads):
    cos, sin = rotation_table(64, 4096, {"rope_type": "default", "rope_theta": 10000.0})
    x = torch.randn(512, 8 * 64).to(dtype)
    positions = torch.arange(512)
    want = rotary_reference(x, cos, sin, positions, 64)
    with torch_threads(threads):
        assert torch.equal(rotary_cpu_(x, cos, sin, positions, 64), want)


def test_float16_takes_the_reference_and_leaves_x():
    cos, sin = rotation_table(16, 64, {"rope_type": "default", "rope_theta": 10000.0})
    x = torch.randn(3, 32, dtype=torch.float16)
    before = x.clone()
    positions = torch.tensor([0, 5, 63])
    out = rotary_cpu_(x, cos, sin, positions, 16)
    assert torch.equal(x, before) and torch.equal(out, rotary_reference(x, cos, sin, positions, 16))


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotates_a_column_slice_of_a_wider_tensor_in_place(tokens, dtype):
    # NOTE: q and k of a fused q|k|v projection are column views of one output
    torch.manual_seed(0)
    head_dim = 8
    cos, sin = rotation_table(head_dim, 16, {"rope_type": "default", "rope_theta": 10000.0})
    positions = torch.tensor([0, 3, 7, 2, 15])[:tokens]
    wide = torch.randn(tokens, 3 * 2 * head_dim).to(dtype)
    q, rest = wide[:, : 2 * head_dim], wide[:, 2 * head_dim :].clone()
    want = rotary_reference(q.clone(), cos, sin, positions, head_dim)
    got = rotary_cpu_(q, cos, sin, positions, head_dim)
    assert got.data_ptr() == wide.data_ptr()  # rotated where it lies
    assert torch.equal(got, want)
    assert torch.equal(wide[:, 2 * head_dim :], rest)
