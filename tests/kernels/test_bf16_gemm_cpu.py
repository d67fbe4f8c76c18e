"""The CPU bfloat16 GEMM (kernels/bf16_gemm_cpu.c, and its AVX2 variant kernels/bf16_gemm_avx2.c)
against a float64 reference: every variant this CPU runs (an AVX-512-BF16 CPU runs both)."""

from __future__ import annotations

import tempfile

import pytest
import torch

from pagedllm.kernels import bf16_gemm_cpu

needs_kernel = pytest.mark.skipif(
    not bf16_gemm_cpu.available(), reason="needs an x86-64 CPU with AVX-512-BF16 or AVX2, numba and a C compiler"
)
VARIANTS_HERE = [v for v in bf16_gemm_cpu.ISAS if bf16_gemm_cpu.runs(v)]
every_variant = pytest.mark.parametrize("variant", VARIANTS_HERE or [None])


def close_to_reference(out: torch.Tensor, x, weight, bias=None) -> None:
    """Each output is the float64 product rounded once to bfloat16, give or take the float32
    sum's rounding: within half a bfloat16 step of the reference, plus k float32 roundings of
    the sum of magnitudes."""
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    scale = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    error = (out.double() - exact).abs()
    k = x.shape[-1]
    assert (error <= exact.abs() * 2**-8 + scale * k * 2**-24 + 1e-30).all(), error.max()


def test_pack_is_a_permutation_of_the_weight():
    w = torch.randn(48, 34).to(torch.bfloat16)
    packed = bf16_gemm_cpu.pack(w)
    assert packed.shape == w.shape and packed.dtype == torch.bfloat16
    assert packed.data_ptr() % 64 == 0
    assert torch.equal(bf16_gemm_cpu.unpack(packed), w)
    # block b, pair p, column c, element i holds w[16 b + c, 2 p + i]
    flat = packed.reshape(3, 17, 16, 2)
    assert flat[2, 5, 7, 1] == w[2 * 16 + 7, 2 * 5 + 1]


@pytest.mark.parametrize(
    "shape",
    [(16, 2), (48, 34), (80, 64), (64 * 3 + 16 * 3, 96), (1152, 896)],
    ids=["one-block", "three-blocks", "five-blocks", "tail-of-three", "qwen-qkv"],
)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 37])
@pytest.mark.parametrize("with_bias", [False, True])
@every_variant
@needs_kernel
def test_gemm_matches_the_reference(shape, rows, with_bias, variant):
    torch.manual_seed(rows * 1000 + shape[0])
    n, k = shape
    w = torch.randn(n, k).to(torch.bfloat16)
    x = torch.randn(rows, k).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16) if with_bias else None
    out = bf16_gemm_cpu.gemm(x, bf16_gemm_cpu.pack(w), bias, variant)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    close_to_reference(out, x, w, bias)
    torch.testing.assert_close(out, bf16_gemm_cpu.gemm_reference(x, w, bias), rtol=2**-7, atol=1e-3 * k**0.5)


@pytest.mark.parametrize("threads", [1, 2, 3])
@every_variant
@needs_kernel
def test_every_thread_count_writes_every_column(threads, variant):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w = torch.randn(16 * 7, 256).to(torch.bfloat16)
        x = torch.randn(5, 256).to(torch.bfloat16)
        assert 5 * 16 * 7 * 256 >= bf16_gemm_cpu.PARALLEL_MIN_WORK  # NOTE: large enough to go parallel
        packed = bf16_gemm_cpu.pack(w)
        out = bf16_gemm_cpu.gemm(x, packed, variant=variant)
        close_to_reference(out, x, w)
    finally:
        torch.set_num_threads(previous)


@every_variant
@needs_kernel
def test_leading_dims_views_and_empty_inputs(variant):
    w = torch.randn(32, 16).to(torch.bfloat16)
    packed = bf16_gemm_cpu.pack(w)
    x = torch.randn(2, 3, 40).to(torch.bfloat16)[..., 8:24]  # not contiguous
    out = bf16_gemm_cpu.gemm(x, packed, variant=variant)
    assert out.shape == (2, 3, 32)
    close_to_reference(out.reshape(6, 32), x.reshape(6, 16), w)
    assert bf16_gemm_cpu.gemm(torch.empty(0, 16, dtype=torch.bfloat16), packed, variant=variant).shape == (0, 32)


@every_variant
@needs_kernel
def test_specials_round_like_torch(variant):
    # NOTE: sums that overflow, NaN inputs and ties at bfloat16's last bit round as torch's cast does
    w = torch.zeros(16, 4, dtype=torch.bfloat16)
    w[:, :2] = 1.0
    x = torch.tensor(
        [[float("nan"), 0, 0, 0], [3e38, 3e38, 0, 0], [-3e38, -3e38, 0, 0], [1, 2**-8, 0, 0], [1 + 2**-7, 2**-8, 0, 0]]
    ).to(torch.bfloat16)
    out = bf16_gemm_cpu.gemm(x, bf16_gemm_cpu.pack(w), variant=variant)
    assert out[0].isnan().all()
    assert (out[1] == float("inf")).all() and (out[2] == float("-inf")).all()
    # NOTE: 1 + 2^-8 and 1 + 3 * 2^-8 lie halfway between bfloat16 neighbours: to the even one
    assert (out[3] == 1).all() and (out[4] == 1 + 2**-6).all()


def test_an_unavailable_variant_is_refused(monkeypatch):
    monkeypatch.setattr(bf16_gemm_cpu, "runs", lambda variant: False)
    packed = bf16_gemm_cpu.pack(torch.zeros(16, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="variant 'avx2' does not run on this CPU"):
        bf16_gemm_cpu.gemm(torch.zeros(1, 8, dtype=torch.bfloat16), packed, variant="avx2")


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"rows a multiple of 16.*\(40, 8\)"):
        bf16_gemm_cpu.pack(torch.zeros(40, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="even number of columns"):
        bf16_gemm_cpu.pack(torch.zeros(16, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float32"):
        bf16_gemm_cpu.pack(torch.zeros(16, 8))
    packed = bf16_gemm_cpu.pack(torch.zeros(16, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"x must be bfloat16 \[\.\.\., 8\], got torch.float32"):
        bf16_gemm_cpu.gemm(torch.zeros(2, 8), packed)
    with pytest.raises(ValueError, match=r"bias must be bfloat16 \[16\]"):
        bf16_gemm_cpu.gemm(torch.zeros(2, 8, dtype=torch.bfloat16), packed, torch.zeros(8, dtype=torch.bfloat16))


def test_a_missing_compiler_leaves_it_unavailable(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    bf16_gemm_cpu._library.cache_clear()
    try:
        assert bf16_gemm_cpu._library() is None
    finally:
        bf16_gemm_cpu._library.cache_clear()


@needs_kernel
def test_built_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path))
    bf16_gemm_cpu._library.cache_clear()
    try:
        path = bf16_gemm_cpu._library()
        assert path is not None and path.parent == tmp_path / "kernels"
        assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial file left behind
    finally:
        bf16_gemm_cpu._library.cache_clear()


@every_variant
@needs_kernel
def test_a_call_does_not_read_the_cpu_flags(monkeypatch, variant):
    # NOTE: reading /proc/cpuinfo takes ~100 us; a decode step makes about a hundred calls
    from pagedllm.kernels import _cpu_compile

    packed = bf16_gemm_cpu.pack(torch.zeros(16, 8, dtype=torch.bfloat16))
    bf16_gemm_cpu.gemm(torch.zeros(1, 8, dtype=torch.bfloat16), packed, variant=variant)
    reads = []
    monkeypatch.setattr(_cpu_compile, "_cpu_flags", lambda: reads.append(1) or set())
    for _ in range(3):
        bf16_gemm_cpu.gemm(torch.zeros(1, 8, dtype=torch.bfloat16), packed, variant=variant)
        bf16_gemm_cpu.gemm(torch.zeros(1, 8, dtype=torch.bfloat16), packed)
    assert reads == []
