"""Which kernel a quantized layer takes on CUDA, picked on CPU with the device's capability faked, and the
Triton kernels it picks run through the interpreter (float32 / float16, tiny shapes) against the float64
dequantize-then-matmul reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.server.config.quantization import QuantConfig
from pagedllm.server.worker.models.tensor_parallel import TPGroup
from pagedllm.server.worker.quantization import fp8_kernels
from pagedllm.server.worker.quantization.base import QuantizedWeight
from pagedllm.server.worker.quantization.fp8_kernels import Fp8ScaledMmKernel, Fp8TritonKernel
from pagedllm.server.worker.quantization.kernels import DequantizeKernel, TritonW4A16Kernel, choose_kernel
from pagedllm.server.worker.quantization.linear import QuantLinear

N, K = 32, 64
CUDA = torch.device("cuda")  # NOTE: only a name here: the kernels keep the CPU tensors they are given


@pytest.fixture
def capability(monkeypatch):
    """Set the compute capability the selection sees: ``capability((8, 0))``."""

    def fake(value: tuple[int, int], scaled_mm_runs: bool = True) -> None:
        monkeypatch.setattr(fp8_kernels, "cuda_capability", lambda device: value)
        monkeypatch.setattr(fp8_kernels, "rowwise_scaled_mm_runs", lambda device: scaled_mm_runs)

    return fake


def fp8_weight(group: int, seed: int) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(N, K, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    return QuantizedWeight(q, torch.rand(N, K // group, generator=gen) * 0.01 + 0.001, None, group, 8)


def int_weight(bits: int, group: int, seed: int) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (N, K), generator=gen).to(torch.uint8)
    zeros = torch.randint(0, 1 << bits, (N, K // group), generator=gen).float()
    return QuantizedWeight(q, torch.rand(N, K // group, generator=gen) * 0.01 + 0.001, zeros, group, bits)


def reference(w: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.dequantize(torch.float64).T


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    err = (got.double() - want).abs().max().item()
    assert err <= rel * want.abs().max().item(), f"max error {err:.3e} vs magnitude {want.abs().max().item():.3e}"


@pytest.mark.parametrize(
    ("cap", "group", "want"),
    [
        ((9, 0), K, Fp8ScaledMmKernel),  # Hopper, one scale per channel
        ((8, 9), K, Fp8ScaledMmKernel),  # Ada
        ((8, 0), K, Fp8TritonKernel),  # Ampere: no fp8 tensor cores
        ((9, 0), 32, Fp8TritonKernel),  # block-wise scales: _scaled_mm takes none
        ((7, 5), 32, Fp8TritonKernel),
    ],
)
def test_fp8_kernel_follows_the_capability_and_the_scales(capability, cap, group, want):
    capability(cap)
    assert isinstance(choose_kernel(fp8_weight(group, 0), CUDA, torch.bfloat16), want)


def test_a_torch_whose_scaled_mm_refuses_row_scales_runs_triton(capability):
    capability((8, 9), scaled_mm_runs=False)
    assert isinstance(choose_kernel(fp8_weight(K, 0), CUDA, torch.bfloat16), Fp8TritonKernel)


def test_the_probe_runs_row_scaled_scaled_mm():
    """torch's CPU build runs ``_scaled_mm`` with row and column scales: the probe says so."""
    assert fp8_kernels.rowwise_scaled_mm_runs(torch.device("cpu"))


def test_shapes_scaled_mm_refuses_go_to_triton_and_what_none_takes_dequantizes(capability):
    capability((9, 0))
    odd = QuantizedWeight(torch.zeros(N, 24).to(torch.float8_e4m3fn), torch.ones(N, 1), None, 24, 8)
    assert isinstance(choose_kernel(odd, CUDA, torch.float16), Fp8TritonKernel)  # K = 24: not a multiple of 16
    ragged = QuantizedWeight(torch.zeros(N, K).to(torch.float8_e4m3fn), torch.ones(N, 8), None, 8, 8)
    assert isinstance(choose_kernel(ragged, CUDA, torch.float16), DequantizeKernel)  # 8-wide blocks
    int8 = QuantizedWeight(torch.zeros(N, K, dtype=torch.int8), torch.ones(N, 1), None, K, 8)
    assert isinstance(choose_kernel(int8, CUDA, torch.float16), DequantizeKernel)


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, K), (8, 16)])
def test_integer_weights_with_zeros_take_the_triton_gemm(bits, group):
    kernel = choose_kernel(int_weight(bits, group, seed=bits), CUDA, torch.float16)
    assert isinstance(kernel, TritonW4A16Kernel) and kernel.bits == bits


def test_cpu_choice_is_untouched_by_a_cuda_capability(capability):
    capability((9, 0))
    assert isinstance(choose_kernel(fp8_weight(K, 0), torch.device("cpu"), torch.float32), DequantizeKernel)


@pytest.mark.parametrize("group", [K, 32, 16])
@pytest.mark.parametrize(("rows", "dtype"), [(1, torch.float32), (5, torch.float32), (3, torch.float16)])
def test_fp8_triton_matches_the_dequantized_weight(group, rows, dtype):
    w = fp8_weight(group, seed=group + rows)
    kernel = Fp8TritonKernel(w)
    x = torch.randn(rows, K).to(dtype)
    assert_close(kernel(x), reference(w, x), 1e-5 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("rows", [1, 4])
def test_fp8_scaled_mm_is_the_per_token_e4m3_product(rows):
    """torch's CPU build runs ``_scaled_mm`` too: the product of the e4m3 activations and weight, exactly."""
    w = fp8_weight(K, seed=rows)
    kernel = Fp8ScaledMmKernel(w)
    x = torch.randn(rows, K)
    x_scale = (x.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
    xq = (x / x_scale).to(torch.float8_e4m3fn).double() * x_scale.double()
    assert_close(kernel(x), reference(w, xq), 1e-2)  # NOTE: rows are rounded to bfloat16 by _scaled_mm
    assert_close(kernel(x), reference(w, x), 8e-2)  # and close to W8A16: e4m3 activations


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 16), (4, 1), (4, K)])
def test_int_triton_matches_the_dequantized_weight(bits, group):
    w = int_weight(bits, group, seed=group)
    x = torch.randn(3, K)
    assert_close(TritonW4A16Kernel(w, torch.float32)(x), reference(w, x), 1e-5)


def block_fp8_layer(dtype: torch.dtype = torch.float32) -> QuantLinear:
    cfg = QuantConfig("fp8", "fp8-block", bits=8, group_size=32, block=(16, 32))
    layer = QuantLinear(cfg, K, N, bias=False, tp=TPGroup())
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        layer.weight.copy_((torch.randn(N, K, generator=gen) * 40).to(torch.float8_e4m3fn))
        layer.weight_scale_inv.copy_(torch.rand(N // 16, K // 32, generator=gen) * 0.01 + 0.001)
    return layer


def test_a_block_fp8_layer_on_cuda_runs_triton_and_gives_the_cpu_output(capability):
    """The layer's one kernel seam: the same checkpoint tensors, finished for CPU and for an sm90 device."""
    capability((9, 0))
    cpu, cuda = block_fp8_layer(), block_fp8_layer()
    cpu.finish(torch.device("cpu"), torch.float32)
    cuda.finish(CUDA, torch.float32)
    assert isinstance(cpu.kernel, DequantizeKernel) and isinstance(cuda.kernel, Fp8TritonKernel)
    x = torch.randn(2, 3, K)
    assert_close(cuda(x), cpu(x).double(), 1e-5)


def test_fused_fp8_parts_keep_their_own_scales_on_cuda(capability):
    capability((8, 0))
    parts = [block_fp8_layer(), block_fp8_layer()]
    with torch.no_grad():
        parts[1].weight_scale_inv.mul_(3)
    want = [nn.functional.linear(torch.eye(K), p.quantized_weight().dequantize()) for p in (block_fp8_layer(),)]
    fused = QuantLinear.fused(parts)
    assert fused is not None
    fused.finish(CUDA, torch.float32)
    assert isinstance(fused.kernel, Fp8TritonKernel)
    first, second = fused(torch.eye(K))
    assert_close(first, want[0].double(), 1e-5)
    assert_close(second, 3 * want[0].double(), 1e-5)


@pytest.mark.parametrize("fmt", ["online-fp8", "fp8-w8a8"])
def test_per_channel_fp8_layers_on_sm90_run_scaled_mm_close_to_the_cpu_reference(capability, fmt):
    """``--quantization fp8`` and compressed-tensors FP8 W8A8 (per tensor here): one layer finished for CPU
    and for an sm90 device; they differ by the activations' e4m3 rounding only."""
    capability((9, 0))
    cfg = QuantConfig(fmt, fmt, bits=8, group_size=-1, per_tensor=fmt == "fp8-w8a8")
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(N, K, generator=gen) * 0.1
    layers = []
    for device in (torch.device("cpu"), CUDA):
        layer = QuantLinear(cfg, K, N, bias=False, tp=TPGroup())
        with torch.no_grad():
            if fmt == "online-fp8":
                layer.weight.copy_(w)
            else:
                layer.weight.copy_((w / 0.001).clamp(-448, 448).to(torch.float8_e4m3fn))
                layer.weight_scale.fill_(0.001)
        layer.finish(device, torch.float32)
        layers.append(layer)
    assert isinstance(layers[0].kernel, DequantizeKernel) and isinstance(layers[1].kernel, Fp8ScaledMmKernel)
    x = torch.randn(4, K, generator=gen)
    assert_close(layers[1](x), layers[0](x).double(), 8e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 33, 200])
def test_on_a_gpu_each_weight_takes_its_kernel_and_matches_the_reference(rows):
    """No faking: the device's own capability and probe pick; bfloat16 activations."""
    device = torch.device("cuda")
    scaled_mm = fp8_kernels.cuda_capability(device) >= (8, 9) and fp8_kernels.rowwise_scaled_mm_runs(device)
    cases = [
        (fp8_weight(K, 1), Fp8ScaledMmKernel if scaled_mm else Fp8TritonKernel, 8e-2),
        (fp8_weight(32, 2), Fp8TritonKernel, 2e-2),
        (int_weight(4, 32, 3), TritonW4A16Kernel, 2e-2),
        (int_weight(8, K, 4), TritonW4A16Kernel, 2e-2),
    ]
    x = torch.randn(rows, K)
    for w, want, rel in cases:
        kernel = choose_kernel(w, device, torch.bfloat16).to(device)
        assert isinstance(kernel, want)
        assert_close(kernel(x.to(device, torch.bfloat16)).cpu(), reference(w, x), rel)
