"""The CPU 4-bit weight-only GEMM (kernels/w4_gemm_cpu.c, and its AVX2 variant kernels/w4_gemm_avx2.c) against
a float64 reference on the dequantized weight: every variant this CPU runs (an AVX-512-BF16 CPU runs both)."""

from __future__ import annotations

import functools
import threading

import pytest
import torch

from pagedllm.kernels import _cpu_memory, w4_gemm_cpu

needs_kernel = pytest.mark.skipif(
    not w4_gemm_cpu.available(), reason="needs an x86-64 CPU with AVX-512-BF16 or AVX2, numba and a C compiler"
)
VARIANTS_HERE = [v for v in w4_gemm_cpu.ISAS if w4_gemm_cpu.runs(v)]
every_variant = pytest.mark.parametrize("variant", VARIANTS_HERE or [None])
GROUPS = [32, 64, 128, 256, "channel"]


def random_weight(n: int, k: int, group: int, seed: int, bits: int = 4):
    """Levels 0 .. 2^bits - 1, zeros likewise, scales shrunk with the levels' range."""
    gen = torch.Generator().manual_seed(seed)
    top, shrink = 1 << bits, 16 / (1 << bits)
    q = torch.randint(0, top, (n, k), generator=gen).to(torch.uint8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.1 + 0.01) * shrink
    zeros = torch.randint(0, top, (n, k // group), generator=gen).float()
    return q, scales, zeros


def close_to_reference(out: torch.Tensor, x, q, scales, zeros, group: int) -> None:
    """Each output is the float64 product rounded once to bfloat16, give or take the float32 sums'
    rounding. Per group the kernel sums S = x . (128 + q) and xsum = sum x in float32 (each within
    ``group`` roundings of 143 |x| summed, as 128 + q and 128 + zero are at most 143), forms
    S - (128 + zero) xsum and adds ``scale`` times it into the output (one rounding each, one more
    per group for the running sum). NOTE: the 128 cancels, so the float32 error scales with
    143 * scale * |x| summed, not with the product itself: bound it by
    (2 group + 2 groups + 4) roundings of 2^-24 times 143 * (|x| @ scale^T), plus half a bfloat16
    step of the result (2^-8 relative, as in test_bf16_gemm_cpu.py)."""
    w = (q.double() - zeros.double().repeat_interleave(group, 1)) * scales.double().repeat_interleave(group, 1)
    exact = x.double() @ w.T
    magnitude = 143 * (x.double().abs() @ scales.double().repeat_interleave(group, 1).T)
    groups = x.shape[-1] // group
    error = (out.double() - exact).abs()
    bound = exact.abs() * 2**-8 + magnitude * (2 * group + 2 * groups + 4) * 2**-24 + 1e-30
    assert (error <= bound).all(), (error - bound).max()


def test_pack_spans_lays_two_pairs_of_levels_into_each_column_pair_of_bytes():
    """Byte 2c + e of span t holds q[c, 4t + e] | q[c, 4t + 2 + e] << 4; unpack gives the levels back."""
    q, scales, zeros = random_weight(32, 64, 32, seed=3)
    packed = w4_gemm_cpu.pack_spans(q, scales, zeros, 32)
    assert packed.weight.shape == (2, 16, 32) and packed.weight.data_ptr() % 64 == 0
    for b, t, c, e in [(0, 0, 0, 0), (1, 3, 5, 1), (1, 15, 15, 0), (0, 7, 9, 1)]:
        byte = packed.weight[b, t, 2 * c + e].item()
        assert byte == q[16 * b + c, 4 * t + e].item() | q[16 * b + c, 4 * t + 2 + e].item() << 4
    assert torch.equal(packed.meta, w4_gemm_cpu.pack(q, scales, zeros, 32).meta)
    levels, got_scales, got_zeros = w4_gemm_cpu.unpack(packed)
    assert torch.equal(levels, q) and torch.equal(got_scales, scales.float()) and torch.equal(got_zeros, zeros.float())
    with pytest.raises(ValueError, match="k of 4"):
        w4_gemm_cpu.pack_spans(torch.zeros(16, 6, dtype=torch.uint8), torch.ones(16, 3), torch.zeros(16, 3), 2)
    if w4_gemm_cpu.available():
        with pytest.raises(ValueError, match="one packed by pack_spans runs on gemm_int8"):
            w4_gemm_cpu.gemm(torch.zeros(1, 64, dtype=torch.bfloat16), packed)


def test_pack_lays_pairs_of_levels_into_bytes():
    q, scales, zeros = random_weight(48, 64, 32, seed=0)
    packed = w4_gemm_cpu.pack(q, scales, zeros, 32)
    assert packed.weight.shape == (3, 32, 16) and packed.weight.dtype == torch.uint8
    assert packed.meta.shape == (3, 2, 2, 16) and packed.meta.dtype == torch.float32
    assert packed.weight.data_ptr() % 64 == 0 and packed.meta.data_ptr() % 64 == 0
    # block b, pair p, column c holds q[16 b + c, 2 p] | q[16 b + c, 2 p + 1] << 4
    assert packed.weight[2, 5, 7] == q[39, 10] | (q[39, 11] << 4)
    assert packed.meta[1, 1, 0, 3] == scales[19, 1] and packed.meta[1, 1, 1, 3] == 128 + zeros[19, 1]
    unpacked = w4_gemm_cpu.unpack(packed)
    assert all(torch.equal(a, b) for a, b in zip(unpacked, (q, scales, zeros)))


@pytest.mark.parametrize(
    ("n", "k"),
    [(16, 512), (48, 512), (80, 512), (96, 512), (64 * 3 + 16 * 3, 256)],
    ids=["one-block", "three-blocks", "tail-of-one", "tail-of-two", "tail-of-three"],
)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 37])
@every_variant
@needs_kernel
def test_gemm_matches_the_reference(n, k, group, rows, variant):
    group = k if group == "channel" else group
    q, scales, zeros = random_weight(n, k, group, seed=rows * 1000 + n + group)
    x = torch.randn(rows, k).to(torch.bfloat16)
    out = w4_gemm_cpu.gemm(x, w4_gemm_cpu.pack(q, scales, zeros, group), variant)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    close_to_reference(out, x, q, scales, zeros, group)


@pytest.mark.parametrize(
    ("rows", "k", "group"),
    [(16, 2048, 32), (17, 2048, 32), (1, 4864, 4864), (3, 40, 40), (64, 40, 40)],
    ids=["sums-in-kernel-up-to-the-limit", "sums-from-torch-past-it", "one-long-group", "tail-group", "tail-rows"],
)
@every_variant
@needs_kernel
def test_group_sums_either_side_of_the_kernels_own(rows, k, group, variant):
    """The kernel sums x's groups itself up to LOCAL_SUMS of them (16 rows x 64 groups here),
    torch past that; groups not a multiple of 16 inputs end in a scalar tail."""
    assert (rows * (k // group) <= w4_gemm_cpu.LOCAL_SUMS) == (rows != 17)
    q, scales, zeros = random_weight(32, k, group, seed=rows + k)
    x = torch.randn(rows, k).to(torch.bfloat16)
    out = w4_gemm_cpu.gemm(x, w4_gemm_cpu.pack(q, scales, zeros, group), variant)
    close_to_reference(out, x, q, scales, zeros, group)


@pytest.mark.parametrize("rows", [1, 16, 37])
@every_variant
@needs_kernel
def test_a_real_projection_shape(rows, variant):
    """Qwen2.5-0.5B's fused q/k/v projection (1152 x 896) in AWQ's group of 128."""
    q, scales, zeros = random_weight(1152, 896, 128, seed=rows)
    x = torch.randn(rows, 896).to(torch.bfloat16)
    out = w4_gemm_cpu.gemm(x, w4_gemm_cpu.pack(q, scales, zeros, 128), variant)
    close_to_reference(out, x, q, scales, zeros, 128)
    torch.testing.assert_close(out, w4_gemm_cpu.w4_gemm_reference(x, q, scales, zeros, 128), rtol=2**-7, atol=0.05)


@every_variant
@needs_kernel
def test_levels_as_far_from_their_zero_as_they_go(variant):
    """q = 15 against zero 0 and q = 0 against zero 15 (all in one weight): the widest (q - zero)."""
    even = torch.arange(64)[:, None] % 2 == 0  # [64, 1]: even columns q = 0, zero 15; odd ones q = 15, zero 0
    q = torch.where(even, 0, 15).expand(64, 128).to(torch.uint8).contiguous()
    zeros = torch.where(even, 15.0, 0.0).expand(64, 2).contiguous()
    scales = torch.full((64, 2), 0.5)
    x = torch.randn(3, 128).to(torch.bfloat16)
    out = w4_gemm_cpu.gemm(x, w4_gemm_cpu.pack(q, scales, zeros, 64), variant)
    close_to_reference(out, x, q, scales, zeros, 64)


@every_variant
@needs_kernel
def test_specials_reach_the_output(variant):
    """A NaN or an infinity in x reaches every output it multiplies into (a NaN stays a NaN); the
    rest of the row stays finite and exact."""
    q, scales, zeros = random_weight(32, 128, 64, seed=5)
    x = torch.randn(3, 128).to(torch.bfloat16)
    x[0, 7], x[1, 100] = float("nan"), float("inf")
    out = w4_gemm_cpu.gemm(x, w4_gemm_cpu.pack(q, scales, zeros, 64), variant)
    assert out[0].isnan().all()
    assert not out[1].isfinite().any()
    close_to_reference(out[2:], x[2:], q, scales, zeros, 64)


def test_an_unavailable_variant_is_refused(monkeypatch):
    monkeypatch.setattr(w4_gemm_cpu, "runs", lambda variant: False)
    packed = w4_gemm_cpu.pack(*random_weight(16, 64, 32, seed=2), 32)
    with pytest.raises(ValueError, match="variant 'avx2' does not run on this CPU"):
        w4_gemm_cpu.gemm(torch.zeros(1, 64, dtype=torch.bfloat16), packed, "avx2")


def test_bad_inputs_are_named():
    q, scales, zeros = random_weight(16, 64, 32, seed=2)
    with pytest.raises(ValueError, match=r"n a multiple of 16.*\(40, 64\)"):
        w4_gemm_cpu.pack(torch.zeros(40, 64, dtype=torch.uint8), scales, zeros, 32)
    with pytest.raises(ValueError, match="group 48"):
        w4_gemm_cpu.pack(q, scales, zeros, 48)
    with pytest.raises(ValueError, match=r"scales and zeros must be \[16, 2\]"):
        w4_gemm_cpu.pack(q, scales[:, :1], zeros, 32)
    packed = w4_gemm_cpu.pack(q, scales, zeros, 32)
    with pytest.raises(ValueError, match=r"x must be bfloat16 \[\.\.\., 64\], got torch.float32"):
        w4_gemm_cpu.gemm(torch.zeros(2, 64), packed)
    with pytest.raises(ValueError, match="meta must be float32"):
        w4_gemm_cpu.gemm(torch.zeros(2, 64, dtype=torch.bfloat16), packed._replace(meta=packed.meta.bfloat16()))


needs_int8 = pytest.mark.skipif(
    not w4_gemm_cpu.int8_available(), reason="needs AVX-512-BF16 with VNNI and VBMI, or AVX2; numba and a C compiler"
)
needs_w8 = pytest.mark.skipif(
    not w4_gemm_cpu.w8_available(), reason="needs AVX-512-BF16, VNNI and VBMI, numba and a C compiler"
)
INT8_VARIANTS_HERE = [v for v in w4_gemm_cpu.ISAS if w4_gemm_cpu.int8_runs(v)]
every_int8_variant = pytest.mark.parametrize("variant", INT8_VARIANTS_HERE or [None])


def rounded_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] as the int8 product rounds it, in torch: levels [m, groups, group] and scales [m, groups, 1]."""
    m, k = x.shape
    grouped = x.float().view(m, k // group, group)
    top = grouped.abs().amax(-1, keepdim=True)
    inverse = torch.where(top > 0, torch.tensor(127.0) / top, torch.zeros_like(top))
    return torch.round(grouped * inverse), top / 127.0


def close_to_int8_reference(out: torch.Tensor, x, q, scales, zeros, group: int) -> None:
    """Per group the kernel's int32 sum of (128 + q) times the int8 levels is exact, and so is
    S - (128 + zero) * (sum of levels) for integer zeros; each group then adds scale * sx times it
    (two roundings: the product of the scales, the fused multiply-add into the running sum). Bound
    by (2 groups + 4) roundings of 2^-24 times the groups' terms summed in size, plus half a
    bfloat16 step of the result (2^-8 relative)."""
    levels, sx = rounded_rows(x, group)  # [m, G, group], [m, G, 1]
    n, k = q.shape
    centred = (q.double() - zeros.double().repeat_interleave(group, 1)).view(n, k // group, group)  # [n, G, group]
    folded = torch.einsum("mgi,ngi->mng", levels.double(), centred)  # [m, n, G]: exact integers
    terms = folded * sx.double().squeeze(-1)[:, None, :] * scales.double()[None]  # [m, n, G]
    exact, magnitude = terms.sum(-1), terms.abs().sum(-1)
    groups = k // group
    error = (out.double() - exact).abs()
    bound = exact.abs() * 2**-8 + magnitude * (2 * groups + 4) * 2**-24 + 1e-30
    assert (error <= bound).all(), (error - bound).max()


@pytest.mark.parametrize("group", [32, 64, 128, 256, 80])
@every_int8_variant
@needs_int8
def test_rows_round_to_int8_as_the_reference_does(group, variant):
    """Levels round x * (127 / max |x|) to nearest even per row and group; the stats hold max / 127 and
    the sum of the levels; a group of zeros has scale 0 and zero levels."""
    k = group * 4
    x = (torch.randn(5, k) * torch.logspace(-3, 3, 5)[:, None]).to(torch.bfloat16)
    x[2, group : 2 * group] = 0
    levels, stats = w4_gemm_cpu.quantize_rows(x, group, variant)
    want, sx = rounded_rows(x, group)
    assert torch.equal(levels.float().view_as(want), want)
    assert levels.abs().max() == 127
    assert torch.equal(stats[..., 0], sx.squeeze(-1)) and torch.equal(stats[..., 1], want.sum(-1))
    assert stats[2, 1, 0] == 0 and (levels[2, group : 2 * group] == 0).all()


@pytest.mark.parametrize(
    ("n", "k"),
    [(16, 512), (48, 512), (80, 512), (96, 512), (64 * 3 + 16 * 3, 256)],
    ids=["one-block", "three-blocks", "tail-of-one", "tail-of-two", "tail-of-three"],
)
@pytest.mark.parametrize("group", [32, 64, 128, 256, "channel"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 37, 70])
@pytest.mark.parametrize("bits", [4, 8])
@every_int8_variant
@needs_int8
def test_int8_gemm_matches_its_reference(n, k, group, rows, bits, variant):
    """Every tile shape (rows 1-4 of a pass, blocks 1-4 of a tile), every group, and from 64 rows x
    quantized a share of rows per thread; 8-bit levels 0..255 against zeros 0..255 take the same bound
    (the 128 + q and 128 + zero sums are exact in int32 and float32 alike)."""
    if bits == 8 and variant != "avx512-bf16":
        pytest.skip("8-bit packings run on the AVX-512 int8 product only")
    group = k if group == "channel" else group
    pack = functools.partial(w4_gemm_cpu.int8_pack, variant=variant) if bits == 4 else w4_gemm_cpu.pack8
    q, scales, zeros = random_weight(n, k, group, seed=rows * 1000 + n + group, bits=bits)
    x = torch.randn(rows, k).to(torch.bfloat16)
    out = w4_gemm_cpu.gemm_int8(x, pack(q, scales, zeros, group), variant)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    close_to_int8_reference(out, x, q, scales, zeros, group)
    torch.testing.assert_close(out, w4_gemm_cpu.w4a8_reference(x, q, scales, zeros, group), rtol=2**-7, atol=0.05)


@pytest.mark.parametrize("group", [16, 48, 80])
@pytest.mark.parametrize("rows", [1, 4, 5])
@every_int8_variant
@needs_int8
def test_int8_gemm_takes_groups_that_end_inside_a_span_of_16_bit_sums(group, rows, variant):
    """Groups of 8, 24 and 40 pairs: the AVX2 product widens its 16-bit sums every 16 pairs and at a
    group's end, so a group need not be a multiple of that span."""
    n, k = 64, group * 6
    q, scales, zeros = random_weight(n, k, group, seed=group + rows)
    x = torch.randn(rows, k).to(torch.bfloat16)
    out = w4_gemm_cpu.gemm_int8(x, w4_gemm_cpu.int8_pack(q, scales, zeros, group, variant), variant)
    close_to_int8_reference(out, x, q, scales, zeros, group)


@pytest.mark.parametrize("rows", [1, 16, 100])
@every_int8_variant
@needs_int8
def test_int8_gemm_is_within_the_rounding_of_x_of_the_exact_product(rows, variant):
    """Against the bfloat16 x's own product: each input moves by at most half its group's step
    (max / 254), so an output by at most that times the weights' sizes summed, plus bfloat16's rounding."""
    q, scales, zeros = random_weight(1152, 896, 128, seed=rows)
    x = torch.randn(rows, 896).to(torch.bfloat16)
    out = w4_gemm_cpu.gemm_int8(x, w4_gemm_cpu.int8_pack(q, scales, zeros, 128, variant), variant)
    w = (q.double() - zeros.double().repeat_interleave(128, 1)) * scales.double().repeat_interleave(128, 1)
    exact = x.double() @ w.T
    step = x.double().view(rows, 7, 128).abs().amax(-1).repeat_interleave(128, 1) / 254  # [rows, k]
    bound = step @ w.abs().T + exact.abs() * 2**-8 + 1e-6
    assert ((out.double() - exact).abs() <= bound).all()
    # and well inside it: normally distributed x moves a product by ~0.7% of its size, not the bound
    assert (out.double() - exact).norm() < 0.02 * exact.norm()


PRODUCTS = [
    *(
        pytest.param(
            (functools.partial(w4_gemm_cpu.gemm, variant=v), close_to_reference, w4_gemm_cpu.pack), id=f"bf16-x-{v}"
        )
        for v in VARIANTS_HERE
    ),
    *(
        pytest.param(
            (
                functools.partial(w4_gemm_cpu.gemm_int8, variant=v),
                close_to_int8_reference,
                functools.partial(w4_gemm_cpu.int8_pack, variant=v),
            ),
            id=f"int8-x-{v}",
        )
        for v in INT8_VARIANTS_HERE
    ),
]
"""The two products of a 4-bit weight, the bound each is checked by and the packing each reads."""


@pytest.mark.parametrize("product", PRODUCTS)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_every_thread_count_writes_every_column(product, threads, rows):
    """From 64 rows the int8 product's threads also quantize x a share of rows each; one row (a tile of
    four blocks a pass) over seven blocks gives two or three threads shares that start inside a tile."""
    gemm, check, pack = product
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        k = 2560
        q, scales, zeros = random_weight(16 * 7, k, 64, seed=threads)
        x = torch.randn(rows, k).to(torch.bfloat16)
        assert rows * 16 * 7 * k >= w4_gemm_cpu.PARALLEL_MIN_WORK  # NOTE: large enough to go parallel
        assert (rows >= w4_gemm_cpu.PARALLEL_QUANTIZE_ROWS) == (rows == 70)
        check(gemm(x, pack(q, scales, zeros, 64)), x, q, scales, zeros, 64)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("product", PRODUCTS)
def test_leading_dims_views_and_empty_inputs(product):
    gemm, check, pack = product
    q, scales, zeros = random_weight(32, 64, 32, seed=1)
    packed = pack(q, scales, zeros, 32)
    x = torch.randn(2, 3, 80).to(torch.bfloat16)[..., 8:72]  # not contiguous
    out = gemm(x, packed)
    assert out.shape == (2, 3, 32)
    check(out.reshape(6, 32), x.reshape(6, 64), q, scales, zeros, 32)
    assert gemm(torch.empty(0, 64, dtype=torch.bfloat16), packed).shape == (0, 32)


@needs_int8
def test_int8_product_names_what_it_refuses():
    q, scales, zeros = random_weight(16, 80, 40, seed=2)
    with pytest.raises(ValueError, match="groups of a multiple of 16 inputs, got 40"):
        w4_gemm_cpu.gemm_int8(torch.zeros(1, 80, dtype=torch.bfloat16), w4_gemm_cpu.pack(q, scales, zeros, 40))
    packed = w4_gemm_cpu.int8_pack(*random_weight(32, 64, 32, seed=1), 32)
    with pytest.raises(ValueError, match=r"x must be bfloat16 \[\.\.\., 64\], got torch.float32"):
        w4_gemm_cpu.gemm_int8(torch.zeros(2, 64), packed)
    other = w4_gemm_cpu.pack if w4_gemm_cpu.int8_isa() == "avx2" else w4_gemm_cpu.pack_spans
    wanted = "pack_spans" if w4_gemm_cpu.int8_isa() == "avx2" else "pack"
    with pytest.raises(ValueError, match=f"takes a 4-bit weight packed by {wanted}$"):
        w4_gemm_cpu.gemm_int8(torch.zeros(2, 64, dtype=torch.bfloat16), other(*random_weight(32, 64, 32, seed=1), 32))
    with pytest.raises(ValueError, match="group 40"):
        w4_gemm_cpu.quantize_rows(torch.zeros(1, 80, dtype=torch.bfloat16), 40)


@every_int8_variant
@needs_int8
def test_one_prepared_product_serves_calls_of_any_row_count(variant):
    """An ``Int8Product`` kept across calls (as a layer keeps one) gives what ``gemm_int8`` gives, call
    after call, whatever the rows: nothing of one call's x stays for the next."""
    q, scales, zeros = random_weight(48, 256, 64, seed=5)
    packed = w4_gemm_cpu.int8_pack(q, scales, zeros, 64, variant)
    product = w4_gemm_cpu.Int8Product(packed, variant)
    assert (product.n, product.k, product.group) == (48, 256, 64)
    for rows in (1, 16, 3, 70, 1):
        x = torch.randn(rows, 256).to(torch.bfloat16)
        out = product(x)
        assert torch.equal(out, w4_gemm_cpu.gemm_int8(x, packed, variant))
        close_to_int8_reference(out, x, q, scales, zeros, 64)
    with pytest.raises(ValueError, match=r"x must be bfloat16 \[\.\.\., 256\], got torch.bfloat16 \(2, 128\)"):
        product(torch.zeros(2, 128, dtype=torch.bfloat16))


@every_int8_variant
@needs_int8
def test_threads_calling_one_product_at_once_each_get_their_own_rows(variant):
    """Each thread keeps its own work buffer for x's levels (a call leaves the GIL inside the product), and a
    call past ``_cpu_memory.SCRATCH_BYTES`` of them gets one of its own."""
    q, scales, zeros = random_weight(64, 512, 128, seed=6)
    product = w4_gemm_cpu.Int8Product(w4_gemm_cpu.int8_pack(q, scales, zeros, 128, variant), variant)
    xs = [torch.randn(rows, 512).to(torch.bfloat16) for rows in (1, 3, 2, 5)]
    wanted = [w4_gemm_cpu.gemm_int8(x, product.packed, variant) for x in xs]
    wrong: list[int] = []

    def call(i: int) -> None:
        for _ in range(200):
            if not torch.equal(product(xs[i]), wanted[i]):
                wrong.append(i)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong
    rows = _cpu_memory.SCRATCH_BYTES // 512 + 1
    x = torch.randn(rows, 512).to(torch.bfloat16)
    close_to_int8_reference(product(x), x, q, scales, zeros, 128)


def test_w4a8_switch_keeps_bfloat16_activations(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_W4A8", "0")
    w4_gemm_cpu.int8_isa.cache_clear()
    try:
        assert not w4_gemm_cpu.int8_available() and not w4_gemm_cpu.w8_available()
    finally:
        monkeypatch.undo()
        w4_gemm_cpu.int8_isa.cache_clear()


@pytest.mark.skipif(not w4_gemm_cpu.int8_runs("avx2"), reason="needs AVX2, numba and a C compiler")
def test_an_8bit_packing_is_refused_by_the_avx2_int8_product():
    q, scales, zeros = random_weight(16, 64, 32, seed=0, bits=8)
    with pytest.raises(ValueError, match="8-bit packing runs on the avx512-bf16 int8 product only, not 'avx2'"):
        w4_gemm_cpu.gemm_int8(torch.zeros(1, 64, dtype=torch.bfloat16), w4_gemm_cpu.pack8(q, scales, zeros, 32), "avx2")


def test_an_int8_variant_that_does_not_run_is_refused(monkeypatch):
    """NOTE: the error names the variant that does run (int8_isa, cached): the cache is cleared after, so
    the patched answer does not outlive the test."""
    before = w4_gemm_cpu.int8_isa()
    monkeypatch.setattr(w4_gemm_cpu, "int8_runs", lambda variant: False)
    w4_gemm_cpu.int8_isa.cache_clear()
    packed = w4_gemm_cpu.pack(*random_weight(16, 64, 32, seed=2), 32)
    try:
        with pytest.raises(ValueError, match="variant 'avx2' does not run on this CPU; it runs None"):
            w4_gemm_cpu.gemm_int8(torch.zeros(1, 64, dtype=torch.bfloat16), packed, "avx2")
    finally:
        monkeypatch.undo()
        w4_gemm_cpu.int8_isa.cache_clear()
    assert w4_gemm_cpu.int8_isa() == before


def test_pack8_lays_quads_of_levels_into_lanes():
    q, scales, zeros = random_weight(48, 64, 32, seed=0, bits=8)
    packed = w4_gemm_cpu.pack8(q, scales, zeros, 32)
    assert packed.weight.shape == (3, 16, 64) and packed.weight.dtype == torch.uint8
    assert packed.weight.data_ptr() % 64 == 0 and packed.meta.data_ptr() % 64 == 0
    # block b, quad t, column c, input i: q[16 b + c, 4 t + i] at byte 4 c + i
    assert packed.weight[2, 5, 4 * 7 + 3] == q[39, 23]
    assert torch.equal(packed.meta, w4_gemm_cpu.pack(q & 15, scales, zeros, 32).meta)
    with pytest.raises(ValueError, match=r"k of 4.*\(16, 66\)"):
        w4_gemm_cpu.pack8(torch.zeros(16, 66, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1), 66)
    with pytest.raises(ValueError, match="an 8-bit weight"):
        w4_gemm_cpu.gemm(torch.zeros(1, 64, dtype=torch.bfloat16), packed)


@needs_w8
def test_int8_gemm_of_8bit_levels_as_far_from_their_zero_as_they_go():
    """q = 255 against zero 0 and q = 0 against zero 255, x at +-max: the largest int32 sums."""
    even = torch.arange(32)[:, None] % 2 == 0
    q = torch.where(even, 0, 255).expand(32, 256).to(torch.uint8).contiguous()
    zeros = torch.where(even, 255.0, 0.0).expand(32, 1).contiguous()
    scales = torch.full((32, 1), 0.01)
    x = torch.where(torch.arange(256) % 3 == 0, 4.0, -4.0).expand(3, 256).to(torch.bfloat16).contiguous()
    out = w4_gemm_cpu.gemm_int8(x, w4_gemm_cpu.pack8(q, scales, zeros, 256))
    close_to_int8_reference(out, x, q, scales, zeros, 256)
