"""fused_add_rms_norm / rms_norm: the Triton kernel against a float64 oracle and the reference,
in place, for LLaMA's and Gemma's weights."""

import pytest
import torch
from kernel_factories import DEVICE, gpu_test

from pagedllm.kernels.fused_add_rms_norm import fused_add_rms_norm, fused_add_rms_norm_reference, rms_norm

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _oracle(x, residual, weight, eps, gemma):
    s = x.double() if residual is None else x.double() + residual.double()
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return normed * (1.0 + weight.double()) if gemma else normed * weight.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 96), (33, 200)])
@pytest.mark.parametrize("gemma", [False, True])
def test_fused_add_in_place_matches_oracle(seed, dtype, rows, hidden, gemma):
    x = (torch.randn(rows, hidden) * 3).to(dtype).to(DEVICE)
    residual = torch.randn(rows, hidden).to(dtype).to(DEVICE)
    weight = (torch.randn(hidden) * 0.5 + (0.0 if gemma else 1.0)).to(dtype).to(DEVICE)
    summed = (x.float() + residual.float()).to(dtype)  # the sum rounded once, as torch adds
    expected = _oracle(summed, None, weight, 1e-6, gemma)
    x_in, r_in = x.clone(), residual.clone()
    out, res = fused_add_rms_norm(x_in, r_in, weight, 1e-6, gemma)
    assert out is x_in and res is r_in
    assert torch.equal(res, summed), f"seed={seed}"
    torch.testing.assert_close(out.double(), expected, **TOL[dtype], msg=lambda e: f"seed={seed}: {e}")
    ref_out, ref_sum = fused_add_rms_norm_reference(x, residual, weight, 1e-6, gemma)
    assert torch.equal(ref_sum, summed)
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[dtype], msg=lambda e: f"seed={seed}: {e}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_of_strided_heads_into_a_new_tensor(seed, dtype):
    # q of a fused q/k/v output viewed as [tokens, heads, head_dim]: rows at stride 3 * 4 * 32
    qkv = torch.randn(5, 3 * 4 * 32).to(dtype).to(DEVICE)
    q = qkv[:, : 4 * 32].view(5, 4, 32)
    before = qkv.clone()
    weight = torch.rand(32).to(dtype).to(DEVICE)
    out = rms_norm(q, weight, 1e-5)
    assert torch.equal(qkv, before)  # the input is left as it was
    assert out.shape == q.shape and out.is_contiguous()
    torch.testing.assert_close(out.double(), _oracle(q, None, weight, 1e-5, False), **TOL[dtype])


def test_launcher_rejects_bad_arguments():
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="weight must be"):
        fused_add_rms_norm(x, x.clone(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        fused_add_rms_norm(x, x.half(), torch.ones(16), 1e-6)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        rms_norm(torch.randn(16, 3).T, torch.ones(16), 1e-6)


@pytest.mark.parametrize("gemma", [False, True])
@gpu_test
def test_bf16_on_gpu_matches_reference(seed, gemma):
    x = torch.randn(64, 4096, device="cuda").bfloat16()
    residual = torch.randn(64, 4096, device="cuda").bfloat16()
    weight = torch.randn(4096, device="cuda").bfloat16()
    ref_out, ref_sum = fused_add_rms_norm_reference(x, residual, weight, 1e-6, gemma)
    out, res = fused_add_rms_norm(x, residual, weight, 1e-6, gemma)
    assert torch.equal(res, ref_sum)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
