"""fp8_matmul: the in-kernel e4m3 decode over every bit pattern, the Triton W8A16 path for each
scale layout against a float64 oracle, the reference, and the launcher's checks."""

import pytest
import torch
from kernel_factories import DEVICE, gpu_test

from pagedllm.kernels.fp8_matmul import (
    dequantize_fp8_reference,
    fp8_linear,
    fp8_linear_reference,
    fp8_matmul_triton,
    fp8_scaled_mm,
    quantize_per_token,
    quantize_per_token_reference,
    quantize_per_token_triton,
)

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=1e-2)}


def _random_weight(n, k, device=DEVICE):
    """A random float8_e4m3fn weight spread over most of e4m3's range, subnormals included."""
    w = torch.randn(n, k) * torch.exp2(torch.randint(-10, 7, (n, k)).float())
    return w.clamp(-448, 448).to(torch.float8_e4m3fn).to(device)


def _scale(mode, n, k, block):
    if mode == "tensor":
        return torch.tensor(0.013)
    if mode == "channel":
        return torch.rand(n) * 0.01 + 1e-3
    return torch.rand(-(-n // block[0]), -(-k // block[1])) * 0.01 + 1e-3


def _oracle(x, weight, scale, block):
    """float64 ``x @ (weight * scale).T``, each scale spread over its block by a plain loop."""
    w = weight.cpu().double()
    s = scale.cpu().double()
    if block is None:
        w = w * (s.reshape(-1, 1) if s.numel() > 1 else s.reshape(()))
    else:
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] *= s[i, j]
    return x.cpu().double() @ w.T


def test_kernel_decodes_every_finite_bit_pattern():
    # x = identity, so y[k, n] = weight[n, k] * 1: the decode alone, exactly (float32, ieee dot)
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = patterns[(patterns & 0x7F) != 0x7F]  # NOTE: 0x7F / 0xFF are NaN in e4m3fn (see the module)
    finite = torch.cat([finite, torch.zeros(2, dtype=torch.uint8)])  # 254 + 2 zeros: [N = 16, K = 16]
    weight = finite.view(torch.float8_e4m3fn).reshape(16, 16)
    x = torch.eye(16)
    y = fp8_matmul_triton(x.to(DEVICE), weight.to(DEVICE), torch.tensor(1.0))
    assert torch.equal(y.cpu(), weight.float().T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "mode,m,n,k,block",
    [
        ("tensor", 1, 48, 64, None),
        ("tensor", 5, 33, 80, None),  # N and K off the tiles
        ("channel", 3, 64, 128, None),
        ("channel", 70, 40, 64, None),  # a prefill tile
        ("block", 1, 80, 160, (32, 64)),  # partial blocks at both edges
        ("block", 9, 64, 256, (16, 128)),
        ("block", 66, 48, 96, (32, 32)),
    ],
)
def test_triton_path_matches_oracle(seed, dtype, mode, m, n, k, block):
    weight = _random_weight(n, k)
    scale = _scale(mode, n, k, block).to(DEVICE)
    x = torch.randn(m, k).to(dtype).to(DEVICE)
    y = fp8_matmul_triton(x, weight, scale, block)
    assert y.dtype == dtype and y.shape == (m, n)
    expected = _oracle(x, weight, scale, block)
    torch.testing.assert_close(y.cpu().double(), expected, **TOL[dtype], msg=lambda e: f"seed={seed}: {e}")


@pytest.mark.parametrize("mode,block", [("tensor", None), ("channel", None), ("block", (16, 32))])
def test_reference_matches_oracle(seed, mode, block):
    weight = _random_weight(40, 96, device="cpu")
    scale = _scale(mode, 40, 96, block)
    x = torch.randn(3, 96)
    expected = _oracle(x, weight, scale, block)
    actual = fp8_linear_reference(x, weight, scale, block).double()
    torch.testing.assert_close(actual, expected, **TOL[torch.float32], msg=lambda e: f"seed={seed}: {e}")


def test_fp8_linear_takes_the_triton_path_off_cuda(seed):
    weight, scale = _random_weight(32, 64), torch.rand(32).to(DEVICE) + 0.5
    x = torch.randn(4, 64).to(DEVICE)
    if DEVICE == "cpu":
        assert torch.equal(fp8_linear(x, weight, scale), fp8_matmul_triton(x, weight, scale))


def _emulated_scaled_mm(x, weight, weight_scale, input_scale):
    """What the tensor cores compute: the e4m3-rounded activations times the dequantized weight, float64."""
    if input_scale is None:  # NOTE: times the reciprocal, as the per-token quantization does
        a_scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12 * 448) / 448
        x_q = (x.float() * (1.0 / a_scale)).clamp(-448, 448).to(torch.float8_e4m3fn)
    else:
        a_scale = input_scale.float().reshape(1, 1)
        x_q = (x.float() / a_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    w = (
        weight.double() * weight_scale.double().reshape(-1, 1)
        if weight_scale.numel() > 1
        else weight.double() * weight_scale.double()
    )
    return (x_q.double() * a_scale.double()) @ w.T


@pytest.mark.parametrize("mode", ["tensor", "channel"])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("swap_ab", [None, True, False])
@pytest.mark.parametrize("m", [1, 5, 64, 67])
def test_scaled_mm_path_equals_its_emulation(seed, mode, static, m, swap_ab):
    # NOTE: torch runs _scaled_mm on the CPU too; on CUDA sm89+ the same call goes to cuBLAS/CUTLASS.
    # The bound (0.5% of the largest output) is the bf16 output's rounding; leaving the activations
    # unquantized would be 2-4% off. Both forms of the product are checked, and the default choice.
    weight = _random_weight(48, 64, device="cpu")
    scale = _scale(mode, 48, 64, None)
    x = (torch.randn(m, 64) * 3).bfloat16()
    input_scale = torch.tensor(0.05) if static else None
    y = fp8_scaled_mm(x, weight, scale, input_scale, swap_ab=swap_ab)
    assert y.dtype == torch.bfloat16 and y.shape == (m, 48) and y.is_contiguous()
    expected = _emulated_scaled_mm(x, weight, scale, input_scale)
    torch.testing.assert_close(y.double(), expected, atol=5e-3 * expected.abs().max().item(), rtol=0,
                               msg=lambda e: f"seed={seed}: {e}")  # fmt: skip


def test_per_token_quantization_maps_each_row_max_to_448():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
    q, scale = quantize_per_token(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 1)
    assert q.float()[0].tolist() == [224.0, -448.0, 112.0]
    assert q.float()[1].tolist() == [0.0, 0.0, 0.0]  # an all-zero row stays zero, no division by zero


def _e4m3_grid_row():
    """One row whose max is 448 (scale 1): every finite e4m3 value, every midpoint between two
    neighbours (ties to even) and the float32 values just either side of each midpoint."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[values.isfinite()].sort().values
    mids = (values[1:] + values[:-1]) / 2
    above, below = mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9))
    return torch.cat([torch.tensor([448.0, -0.0]), values, mids, above, below])[None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k,rows", [(1, 64, 16), (5, 1000, 16), (3, 2500, 3), (17, 48, 32)])
def test_triton_per_token_quantization_is_the_reference(seed, dtype, m, k, rows):
    # rows of very different sizes, a zero row, K over one 1024-wide pass, and zero padding rows
    x = torch.randn(m, k) * torch.exp2(torch.randint(-8, 8, (m, 1)).float())
    x[-1] = 0.0
    x = x.to(dtype).to(DEVICE)
    q, scale = quantize_per_token_triton(x, rows)
    expected_q, expected_scale = quantize_per_token_reference(torch.nn.functional.pad(x.cpu(), (0, 0, 0, rows - m)))
    assert q.shape == (rows, k) and scale.shape == (rows, 1)
    assert torch.equal(q.cpu().view(torch.uint8), expected_q.view(torch.uint8)), f"seed={seed}"
    assert torch.equal(scale.cpu(), expected_scale), f"seed={seed}"


def test_triton_per_token_quantization_rounds_every_e4m3_value_and_tie_as_torch_does():
    x = _e4m3_grid_row()
    q, scale = quantize_per_token_triton(x.to(DEVICE), 1)
    expected, _ = quantize_per_token_reference(x)
    assert scale.item() == 1.0
    assert torch.equal(q.cpu().view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(expected.float(), x.to(torch.float8_e4m3fn).float())  # the reference is torch's own cast


def test_triton_per_token_quantization_rejects_fewer_rows_than_x():
    with pytest.raises(ValueError, match="at least"):
        quantize_per_token_triton(torch.ones(4, 16).to(DEVICE), 2)


def test_dequantize_spreads_block_scales():
    weight = torch.ones(3, 5).to(torch.float8_e4m3fn)
    w = dequantize_fp8_reference(weight, torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), (2, 2))
    assert w.tolist() == [[1, 1, 2, 2, 3], [1, 1, 2, 2, 3], [4, 4, 5, 5, 6]]


def test_launcher_rejects_bad_arguments():
    weight = torch.zeros(32, 64).to(torch.float8_e4m3fn)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(x, weight.float(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="scalar or"):
        fp8_linear(x, weight, torch.ones(5))
    with pytest.raises(ValueError, match="block-wise weight_scale must be"):
        fp8_linear(x, weight, torch.ones(1, 1), block_size=(16, 32))
    with pytest.raises(ValueError, match="input_scale"):
        fp8_linear(x, weight, torch.tensor(1.0), input_scale=torch.ones(2))


@pytest.mark.parametrize("mode,block", [("tensor", None), ("channel", None), ("block", (128, 128))])
@pytest.mark.parametrize("m", [1, 64, 257])
@gpu_test
def test_fp8_linear_on_gpu_bf16(seed, mode, block, m):
    # the _scaled_mm path also rounds the activations to e4m3: a looser bound than the Triton path's
    n, k = 512, 1024
    weight = (torch.randn(n, k, device="cuda") * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = _scale(mode, n, k, block).cuda() * 0.01
    x = torch.randn(m, k, device="cuda").bfloat16()
    expected = fp8_linear_reference(x.float(), weight, scale, block)
    y = fp8_linear(x, weight, scale, block)
    torch.testing.assert_close(y.float(), expected, atol=0.1 * expected.abs().max().item(), rtol=0.1)
