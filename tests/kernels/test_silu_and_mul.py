"""act_and_mul / silu_and_mul: the Triton kernel against a float64 oracle for each activation,
on the strided halves of a fused gate-up output."""

import math

import pytest
import torch
from kernel_factories import DEVICE, gpu_test

from pagedllm.kernels.silu_and_mul import act_and_mul, act_and_mul_reference, silu_and_mul

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}


def _oracle(gate, up, activation):
    g = gate.cpu().double()
    if activation == "silu":
        a = g / (1.0 + torch.exp(-g))
    elif activation == "gelu":
        a = 0.5 * g * (1.0 + torch.erf(g / math.sqrt(2.0)))
    else:
        a = 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))
    return a * up.cpu().double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("tokens,inner", [(1, 64), (5, 100), (3, 2500)])
def test_kernel_matches_oracle_on_fused_halves(seed, dtype, activation, tokens, inner):
    gate_up = (torch.randn(tokens, 2 * inner) * 4).to(dtype).to(DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    out = act_and_mul(gate, up, activation)
    assert out.shape == (tokens, inner) and out.is_contiguous() and out.dtype == dtype
    expected = _oracle(gate, up, activation)
    torch.testing.assert_close(out.cpu().double(), expected, **TOL[dtype], msg=lambda e: f"seed={seed}: {e}")


def test_saturates_without_nan_at_large_magnitudes():
    gate = torch.tensor([[-1e4, -90.0, 0.0, 90.0, 1e4, -30.0, 30.0, 1.0]]).to(DEVICE)
    up = torch.ones_like(gate)
    for activation in ("silu", "gelu", "gelu_tanh"):
        out = act_and_mul(gate, up, activation).cpu()
        assert torch.isfinite(out).all(), activation
        torch.testing.assert_close(out.double(), _oracle(gate, up, activation), atol=1e-5, rtol=1e-5)


def test_silu_and_mul_is_the_silu_activation(seed):
    gate, up = torch.randn(4, 32).to(DEVICE), torch.randn(4, 32).to(DEVICE)
    assert torch.equal(silu_and_mul(gate, up), act_and_mul(gate, up, "silu"))


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_reference_matches_oracle(seed, activation):
    gate, up = torch.randn(3, 40) * 3, torch.randn(3, 40)
    torch.testing.assert_close(act_and_mul_reference(gate, up, activation).double(), _oracle(gate, up, activation),
                               atol=1e-5, rtol=1e-5)  # fmt: skip


def test_launcher_rejects_bad_arguments():
    with pytest.raises(ValueError, match="activation must be"):
        act_and_mul(torch.randn(2, 4), torch.randn(2, 4), "relu")
    with pytest.raises(ValueError, match="one float dtype"):
        act_and_mul(torch.randn(2, 4), torch.randn(2, 4).half())
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        act_and_mul(torch.randn(4, 2).T, torch.randn(2, 4))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@gpu_test
def test_bf16_on_gpu_matches_reference(seed, activation):
    gate, up = torch.randn(2, 64, 14336, device="cuda").bfloat16().unbind(0)
    torch.testing.assert_close(act_and_mul(gate, up, activation).float(),
                               act_and_mul_reference(gate, up, activation).float(), atol=2e-2, rtol=2e-2)  # fmt: skip
