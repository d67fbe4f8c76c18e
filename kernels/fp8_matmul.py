"""FP8 (e4m3fn) weight linear: ``y = x @ (weight * scale).T`` for the three scale layouts
FP8 checkpoints ship::

    per-tensor   weight_scale []  or [1]                        (compressed-tensors, --quantization fp8)
    per-channel  weight_scale [N] or [N, 1]                     (compressed-tensors "channel")
    block-wise   weight_scale [ceil(N / bn), ceil(K / bk)]      (HF "fp8", DeepSeek/Qwen3: bn = bk = 128)

Two paths:

- ``torch._scaled_mm`` on CUDA compute capability 8.9+ for per-tensor and per-channel scales:
  the activations are quantized to e4m3 as well, per token (dynamic: each row's absolute max
  maps to 448) or with the checkpoint's static per-tensor ``input_scale``, and the tensor cores
  multiply FP8 by FP8. Row-wise scales take a bfloat16 output (what every torch build accepts),
  cast to x's dtype.
- otherwise (block-wise scales, older GPUs, shapes ``_scaled_mm`` refuses, the interpreter) a
  Triton GEMM that reads the weight's bytes and decodes and scales them tile by tile in the
  kernel: W8A16, the activations stay in their own precision.

NOTE: the weight reaches the Triton kernel as its uint8 bit pattern and is decoded with
integer ops (:func:`decode_e4m3fn`), not through Triton's float8 type: the conversion
instructions exist from sm89 only, and this path is the one that must run below sm89. Triton's
CPU interpreter loads float8 tensors too (checked: every finite pattern decodes exactly), but it
decodes the two NaN patterns (0x7F, 0xFF) as +-480, and so does this bit decode; checkpoints
hold no NaN weights.
"""

from __future__ import annotations

import torch

from ._triton import check_can_launch, next_pow2, runs_on_triton, tl, triton

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
PER_TENSOR, PER_CHANNEL, BLOCKWISE = 0, 1, 2
SWAP_AB_MAX_ROWS = 0
"""Up to this many tokens :func:`fp8_scaled_mm` multiplies ``weight @ x.T`` unless told otherwise:
none. The swapped product was meant to put the weight's N on the GEMM's long side when cuBLAS
runs 128-row tiles for a handful of tokens, but on an H200 (``benchmarks.gpu_fp8_linear``,
``benchmarks/results/gpu/fp8-linear-2026-11-28-h200-run2.json``) it was slower than the plain
``x_q @ w.T`` in 11 of 12 LLaMA-3-8B projections at 1-64 rows (0.74-0.94x; 1.06x on down at one
row) and 0.60-0.84x at 256: a batch-64 layer's four projections took 154 us swapped, 124 plain.
``swap_ab=True`` still asks for it, for the benchmark."""


@triton.jit
def decode_e4m3fn(bits):
    """float8_e4m3fn bit patterns (any int tensor holding 0..255) as float32 values.

    NOTE: the 7 magnitude bits shifted up by 7 are a float16 whose value is the e4m3 value
    times 2**-8 (the 4-bit exponent sits at the bottom of float16's 5-bit field, and e4m3's
    subnormals land on float16's), so one bitcast and one multiply decode every pattern.
    """
    b = bits.to(tl.int32)
    magnitude = (((b & 0x7F) << 7).to(tl.int16)).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((b & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def fp8_matmul_kernel(
    x_ptr,  # [M, K] float
    w_ptr,  # [N, K] uint8: float8_e4m3fn bit patterns
    scale_ptr,  # [] / [N] / [ceil(N / BN), ceil(K / BK)] float32
    y_ptr,  # [M, N], x's dtype
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_ym,
    stride_yn,
    SCALE_MODE: tl.constexpr,  # PER_TENSOR, PER_CHANNEL or BLOCKWISE
    BN: tl.constexpr,  # weight block rows (BLOCKWISE)
    BK: tl.constexpr,  # weight block columns (BLOCKWISE), a multiple of BLOCK_K
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        bits = tl.load(
            w_ptr + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
            mask=col_ok[None, :] & k_ok[:, None],
            other=0,
        )  # [BLOCK_K, BLOCK_N]: the weight's tile, read transposed
        w = decode_e4m3fn(bits)
        if SCALE_MODE == 2:
            # NOTE: BK is a multiple of BLOCK_K, so the whole K tile lies in one block column
            s = tl.load(scale_ptr + (cols // BN) * stride_sn + (k0 // BK) * stride_sk, mask=col_ok, other=0.0)
            w = w * s[None, :]
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
    if SCALE_MODE == 0:
        acc = acc * tl.load(scale_ptr)
    elif SCALE_MODE == 1:
        acc = acc * tl.load(scale_ptr + cols * stride_sn, mask=col_ok, other=0.0)[None, :]
    y = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def scale_mode(weight: torch.Tensor, weight_scale: torch.Tensor, block_size) -> int:
    """Which scale layout ``weight_scale`` is for ``weight`` [N, K]; ``ValueError`` if none fits."""
    n, k = weight.shape
    if block_size is not None:
        bn, bk = block_size
        blocks = (-(-n // bn), -(-k // bk))
        if tuple(weight_scale.shape) != blocks:
            raise ValueError(f"block-wise weight_scale must be {list(blocks)} for blocks {list(block_size)}, "
                             f"got {list(weight_scale.shape)}")  # fmt: skip
        return BLOCKWISE
    if weight_scale.numel() == 1:
        return PER_TENSOR
    if weight_scale.numel() == n and weight_scale.shape[0] == n:
        return PER_CHANNEL
    raise ValueError(f"weight_scale must be a scalar or [N = {n}] without block_size, got {list(weight_scale.shape)}")


def _check_args(x, weight, weight_scale, block_size, input_scale) -> int:
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be [M, K] in one of {_FLOAT_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"weight must be float8_e4m3fn [N, K = {x.shape[1]}], got {weight.dtype} {tuple(weight.shape)}"
        )
    bad_block = block_size is not None and (len(block_size) != 2 or block_size[0] < 1 or block_size[1] < 16)
    if bad_block or (block_size is not None and block_size[1] % 16):
        raise ValueError(f"block_size must be [bn, bk] with bn >= 1 and bk a multiple of 16, got {block_size}")
    if input_scale is not None and input_scale.numel() != 1:
        raise ValueError(f"input_scale must be one per-tensor value, got shape {list(input_scale.shape)}")
    return scale_mode(weight, weight_scale, block_size)


def _can_use_scaled_mm(x: torch.Tensor, weight: torch.Tensor, mode: int) -> bool:
    if mode == BLOCKWISE or x.device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    n, k = weight.shape
    return torch.cuda.get_device_capability(x.device) >= (8, 9) and n % 16 == 0 and k % 16 == 0


@triton.jit
def round_to_e4m3(v):
    """float32 ``v`` (|v| <= 448) rounded to the nearest e4m3 value, ties to even, still float32.

    NOTE: adding and taking away ``c = 2**(e + 20)`` (``2**e`` the power of two at or below
    |v|) leaves float32 three mantissa bits below it: e4m3's step, with float32's own rounding.
    Exponents below -6 round as -6 (e4m3's subnormals keep the step 2**-9). The cast to e4m3
    that follows is then exact: Triton's interpreter rounds some values wrongly across a power
    of two (124.3 to 64, not 128).
    """
    a = tl.abs(v)
    top = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, (127 - 6) << 23)
    c = (top + (20 << 23)).to(tl.float32, bitcast=True)
    r = (a + c) - c
    return tl.where(v.to(tl.int32, bitcast=True) < 0, -r, r)  # the sign bit: -0.0 stays -0.0


@triton.jit
def quantize_per_token_kernel(
    x_ptr,  # [M, K] float
    q_ptr,  # [rows, K] float8_e4m3fn, rows >= M: the rows past M are written as zeros
    scale_ptr,  # [rows] float32
    M,
    K,
    stride_xm,
    stride_qm,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    live = tl.where(row < M, K, 0)  # the padding rows read nothing: zeros, scale 1e-12
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + ks, mask=ks < live, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
    inverse = tl.div_rn(1.0, scale)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + ks, mask=ks < live, other=0.0).to(tl.float32)
        q = round_to_e4m3(tl.minimum(tl.maximum(x * inverse, -448.0), 448.0))
        tl.store(q_ptr + row * stride_qm + ks, q.to(q_ptr.dtype.element_ty), mask=ks < K)
    tl.store(scale_ptr + row, scale)


def quantize_per_token(x: torch.Tensor, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` [M, K] scaled so its absolute max is 448, as float8_e4m3fn, and the row
    scales [rows, 1] float32; ``rows`` (>= M, M by default) pads both with zero rows.

    :func:`quantize_per_token_triton` on CUDA (one launch where torch's ops take nine), else
    :func:`quantize_per_token_reference`: the same bytes either way.
    """
    rows = x.shape[0] if rows is None else rows
    if runs_on_triton(x):
        return quantize_per_token_triton(x, rows)
    return quantize_per_token_reference(torch.nn.functional.pad(x, (0, 0, 0, rows - x.shape[0])))


def quantize_per_token_triton(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_per_token` as one Triton launch: a pass over each row for its max, a pass to
    scale and round it."""
    check_can_launch(quantize_per_token_kernel, x)
    m, k = x.shape
    if rows < m:
        raise ValueError(f"rows must be at least x's {m} rows, got {rows}")
    x = x if x.stride(1) == 1 else x.contiguous()
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block_k = min(1024, next_pow2(max(k, 16)))
        quantize_per_token_kernel[(rows,)](x, q, scale, m, k, x.stride(0), q.stride(0), BLOCK_K=block_k,
                                           num_warps=4)  # fmt: skip
    return q, scale


def quantize_per_token_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch twin of :func:`quantize_per_token` (the same operations in the same order)."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_scaled_mm(x, weight, weight_scale, input_scale=None, *, swap_ab: bool | None = None) -> torch.Tensor:
    """The ``torch._scaled_mm`` path of :func:`fp8_linear` (per-tensor or per-channel scales): the
    activations quantized to e4m3 too, per token or by the static ``input_scale``.

    With ``swap_ab`` (by default up to :data:`SWAP_AB_MAX_ROWS` tokens, which is none) and
    per-token scales, the product is taken as ``(weight @ x_q.T).T``: the weight's N on the GEMM's
    long side and the few tokens on its short one, padded to the 16 the fp8 GEMM requires
    (benchmarks time both forms).

    NOTE: torch's CPU build runs ``_scaled_mm`` as well, which is how the tests check this path.
    """
    mode = _check_args(x, weight, weight_scale, None, input_scale)
    m, n = x.shape[0], weight.shape[0]
    w_scale = weight_scale.float().reshape(-1)
    if input_scale is not None and mode == PER_TENSOR:
        a_scale = input_scale.float().reshape(())
        x_q = (x.float() / a_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return torch._scaled_mm(x_q, weight.t(), scale_a=a_scale, scale_b=w_scale.reshape(()), out_dtype=x.dtype)
    w_scale = w_scale.expand(n).contiguous() if mode == PER_TENSOR else w_scale  # [N], one per output channel
    swap_ab = 0 < m <= SWAP_AB_MAX_ROWS if swap_ab is None else swap_ab
    if input_scale is None and swap_ab:
        x_q, a_scale = quantize_per_token(x, rows=-(-m // 16) * 16)
        y_t = torch._scaled_mm(weight, x_q.t(), scale_a=w_scale.reshape(n, 1), scale_b=a_scale.reshape(1, -1),
                               out_dtype=torch.bfloat16)  # fmt: skip
        return y_t[:, :m].t().contiguous().to(x.dtype)
    if input_scale is not None:
        a_scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
        x_q = (x.float() / a_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    else:
        x_q, a_scale = quantize_per_token(x)
    y = torch._scaled_mm(x_q, weight.t(), scale_a=a_scale, scale_b=w_scale.reshape(1, n), out_dtype=torch.bfloat16)
    return y.to(x.dtype)


def fp8_linear(
    x: torch.Tensor,  # [M, K] float16, bfloat16 or float32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [] / [N] / [ceil(N / bn), ceil(K / bk)] float
    block_size: tuple[int, int] | list[int] | None = None,  # (bn, bk) for block-wise scales
    input_scale: torch.Tensor | None = None,  # [] static activation scale (the _scaled_mm path)
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x @ (weight * weight_scale).T``: ``torch._scaled_mm`` where it applies, else the Triton
    W8A16 kernel (see the module docstring)."""
    mode = _check_args(x, weight, weight_scale, block_size, input_scale)
    if _can_use_scaled_mm(x, weight, mode):
        return fp8_scaled_mm(x, weight, weight_scale, input_scale)
    return fp8_matmul_triton(x, weight, weight_scale, block_size)


def fp8_matmul_triton(x, weight, weight_scale, block_size=None) -> torch.Tensor:
    """The Triton path of :func:`fp8_linear`, for any scale layout (float32 accumulation)."""
    mode = _check_args(x, weight, weight_scale, block_size, None)
    bits = weight.view(torch.uint8)
    scale = weight_scale.float().reshape(weight_scale.shape if mode == BLOCKWISE else (-1,))
    check_can_launch(fp8_matmul_kernel, x, bits, scale)
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    bn, bk = block_size if block_size is not None else (1, 128)
    block_m = max(16, min(64, next_pow2(m))) if m <= 64 else 128
    block_n = 64 if m <= 64 else 128
    # NOTE: the K tile must divide the scale block's width (a power of two in every checkpoint)
    block_k = min(64 if m > 64 else 128, bk & -bk)
    stride_sn = scale.stride(0) if mode != PER_TENSOR else 0
    stride_sk = scale.stride(1) if mode == BLOCKWISE else 0
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    fp8_matmul_kernel[grid](
        x, bits, scale, y, m, n, k,
        x.stride(0), x.stride(1), bits.stride(0), bits.stride(1), stride_sn, stride_sk, y.stride(0), y.stride(1),
        SCALE_MODE=mode, BN=bn, BK=bk,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=max(16, block_k),
        num_warps=4 if m <= 64 else 8, num_stages=3,
    )  # fmt: skip
    return y


def dequantize_fp8_reference(weight, weight_scale, block_size=None) -> torch.Tensor:  # [N, K] float32
    """``weight * scale`` in float32, each block-wise scale repeated over its block."""
    mode = scale_mode(weight, weight_scale, block_size)
    w = weight.float()
    if mode == PER_TENSOR:
        return w * weight_scale.float().reshape(())
    if mode == PER_CHANNEL:
        return w * weight_scale.float().reshape(-1, 1)
    bn, bk = block_size
    s = weight_scale.float().repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)
    return w * s[: w.shape[0], : w.shape[1]]


def fp8_linear_reference(x, weight, weight_scale, block_size=None, input_scale=None) -> torch.Tensor:
    """Plain-torch twin of :func:`fp8_linear`'s Triton path: dequantize, one float32 matmul.

    ``input_scale`` is checked but not applied: the activations are not quantized here (the
    ``_scaled_mm`` path differs from this by the activations' rounding to e4m3).
    """
    _check_args(x, weight, weight_scale, block_size, input_scale)
    return (x.float() @ dequantize_fp8_reference(weight, weight_scale, block_size).T).to(x.dtype)
