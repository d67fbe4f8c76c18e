"""The compiled RMSNorm (with and without the residual add) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.paged_decode_attention_cpu import HAS_NUMBA
from pagedllm.kernels.rms_norm_cpu import rms_norm_cpu, rms_norm_reference

pytestmark = pytest.mark.skipif(not HAS_NUMBA, reason="numba is not installed")


@pytest.mark.parametrize("tokens,hidden", [(1, 64), (16, 512), (37, 96), (300, 128)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_reference(tokens, hidden, with_residual):
    g = torch.Generator().manual_seed(tokens * hidden)
    x = torch.randn(tokens, hidden, generator=g) * 3
    residual = torch.randn(tokens, hidden, generator=g) if with_residual else None
    weight = torch.randn(hidden, generator=g)
    x_before = x.clone()
    out, summed = rms_norm_cpu(x, weight, 1e-6, residual)
    want_out, want_sum = rms_norm_reference(x, weight, 1e-6, residual)
    assert torch.equal(summed, want_sum)  # the residual stream itself is exact
    # NOTE: only the mean's summation order differs from torch's
    torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-6)
    assert torch.equal(x, x_before)
    if residual is None:
        assert summed is x


def test_other_dtypes_and_shapes_take_the_reference():
    x = torch.randn(4, 3, 16, dtype=torch.bfloat16)
    weight = torch.randn(16, dtype=torch.bfloat16)
    out, summed = rms_norm_cpu(x, weight, 1e-5, x)
    want, want_sum = rms_norm_reference(x, weight, 1e-5, x)
    assert torch.equal(out, want) and torch.equal(summed, want_sum)


def test_non_contiguous_input():
    x = torch.randn(8, 128)[:, :64]
    weight = torch.randn(64)
    out, _ = rms_norm_cpu(x, weight, 1e-6)
    torch.testing.assert_close(out, rms_norm_reference(x, weight, 1e-6)[0], atol=1e-6, rtol=1e-6)
