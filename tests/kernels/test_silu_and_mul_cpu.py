"""The compiled SiLU-and-mul against its torch reference, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import silu_and_mul_cpu as silu_and_mul_module
from pagedllm.kernels.paged_decode_attention_cpu import HAS_NUMBA
from pagedllm.kernels.silu_and_mul_cpu import silu_and_mul_cpu, silu_and_mul_reference
from tests.kernels.kernel_factories import near_bf16_tie, torch_threads

pytestmark = pytest.mark.skipif(not HAS_NUMBA, reason="numba is not installed")


@pytest.fixture(autouse=True)
def kernel_at_every_size(request, monkeypatch):
    """The compiled kernel even where torch's ops would be faster, but in the test of that choice."""
    if "torch_below" not in request.node.name:
        monkeypatch.setattr(silu_and_mul_module, "KERNEL_MIN_ELEMENTS", 0)


# [tokens, inner]: decode sizes on one thread, prefill sizes spread over two (_numba_cpu.launch)
SHAPES = [(1, 8), (16, 1376), (37, 96), (512, 160)]


def _inputs(tokens: int, inner: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, inner, generator=g) * 4).to(dtype), torch.randn(tokens, inner, generator=g).to(dtype)


@pytest.mark.parametrize("tokens,inner", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_float32_within_an_ulp_or_two_of_reference(tokens, inner, threads, seed):
    gate, up = _inputs(tokens, inner, torch.float32, seed)
    with torch_threads(threads):
        got = silu_and_mul_cpu(gate, up)
    # NOTE: not bitwise: the kernel's exp is not torch's (SLEEF); both are within ~1 ulp of exp
    torch.testing.assert_close(got, silu_and_mul_reference(gate, up), rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("tokens,inner", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_bfloat16_bitwise_but_at_near_ties(tokens, inner, threads, seed):
    gate, up = _inputs(tokens, inner, torch.bfloat16, seed)
    with torch_threads(threads):
        got = silu_and_mul_cpu(gate, up)
    want = silu_and_mul_reference(gate, up)
    # NOTE: the SiLU is rounded to bf16 before the product, as torch's two ops do; only where
    # the float32 SiLU is within a few ulps of a bf16 rounding tie may the exp's last bit show
    tie = near_bf16_tie(torch.nn.functional.silu(gate.float()))
    assert torch.equal(got[~tie], want[~tie])
    assert int(tie.sum()) <= max(1, 0.01 * tie.numel())  # NOTE: one near-tie is 12.5% of the 8-element shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_halves_of_one_tensor_are_read_in_place(dtype, seed):
    gate_up = (torch.randn(24, 2 * 96) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert not gate.is_contiguous() and not up.is_contiguous()
    got = silu_and_mul_cpu(gate, up)
    assert got.is_contiguous()
    assert torch.equal(got, silu_and_mul_cpu(gate.contiguous(), up.contiguous()))
    torch.testing.assert_close(
        got, silu_and_mul_reference(gate, up), rtol=1e-6 if dtype == torch.float32 else 0, atol=0
    )


def test_rows_at_a_stride_and_columns_transposed():
    gate = torch.randn(40, 64)[::2, :32]  # every other row
    up = torch.randn(32, 20).t()  # columns strided: copied first
    assert gate.stride() == (128, 1) and up.stride() == (1, 20)
    torch.testing.assert_close(silu_and_mul_cpu(gate, up), silu_and_mul_reference(gate, up), rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extremes_as_torch(dtype):
    g = torch.tensor([-1e4, -100.0, -88.7, -88.5, -87.5, -50.0, -1e-3, 0.0, -0.0, 1e-40, 88.0, 100.0])
    g = torch.cat([g, torch.tensor([torch.inf, -torch.inf, torch.nan])]).to(dtype)[None]
    up = torch.ones_like(g)
    got, want = silu_and_mul_cpu(g, up), silu_and_mul_reference(g, up)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0, equal_nan=True)
    assert torch.equal(got.signbit(), want.signbit())  # -0.0 where exp(-g) overflows, as torch


def test_other_dtypes_and_autograd_take_the_reference():
    gate, up = torch.randn(4, 16, dtype=torch.float16), torch.randn(4, 16, dtype=torch.float16)
    assert torch.equal(silu_and_mul_cpu(gate, up), silu_and_mul_reference(gate, up))
    gate32 = torch.randn(4, 16, requires_grad=True)
    out = silu_and_mul_cpu(gate32, torch.randn(4, 16))
    out.sum().backward()
    assert gate32.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_below_the_kernel_size_bitwise_and_contiguous(dtype, seed):
    gate_up = (torch.randn(2, 2 * 4864) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert gate.numel() < silu_and_mul_module.KERNEL_MIN_ELEMENTS
    got = silu_and_mul_cpu(gate, up)
    assert got.is_contiguous() and torch.equal(got, silu_and_mul_reference(gate, up))
    transposed = silu_and_mul_cpu(gate.t().contiguous().t(), up)
    assert transposed.is_contiguous() and torch.equal(transposed, got)
