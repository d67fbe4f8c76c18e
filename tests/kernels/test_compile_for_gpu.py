"""The new Triton kernels compile to GPU code (Hopper sm90; the FP8 fallback also for Ampere
sm80; decode attention's one-launch split merge, atomics included) without a GPU:
``triton.compile`` for a target, down to a cubin through Triton's ptxas.

The interpreter runs the kernels' arithmetic; this catches what only the compiler sees (types
the GPU lowering refuses, shared memory past the limit). It runs in a subprocess because the
kernels of this process were decorated for the interpreter (tests/conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED_LIMIT = {80: 166912, 90: 232448}  # bytes of shared memory one block may use
FLOATS = {"eps", "scale", "k_scale", "v_scale", "softcap"}  # the kernels' float scalars (the others: int32)


def _cases():
    from pagedllm.kernels.fp8_matmul import fp8_matmul_kernel, quantize_per_token_kernel
    from pagedllm.kernels.fused_add_rms_norm import rms_norm_kernel
    from pagedllm.kernels.paged_decode_attention import paged_decode_attention_kernel
    from pagedllm.kernels.quant_gemv import quant_gemv_kernel
    from pagedllm.kernels.quant_matmul import quant_matmul_kernel, split_k_sum_kernel
    from pagedllm.kernels.rotary_embedding import rotary_embedding_kernel
    from pagedllm.kernels.silu_and_mul import act_and_mul_kernel

    def quant(dt, bits, g_idx, bm, bn, bk, warps, stages, split=1):
        ptrs = dict(x_ptr=dt, qweight_ptr="i32", scales_ptr=dt, zeros_ptr=dt, g_idx_ptr="i32",
                    y_ptr=dt if split == 1 else "fp32")  # fmt: skip
        const = dict(BITS=bits, HAS_G_IDX=g_idx, GROUPS_PER_TILE=0 if g_idx else 1, PRECISION="tf32",
                     BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split)  # fmt: skip
        return quant_matmul_kernel, ptrs, const, 90, dict(num_warps=warps, num_stages=stages)

    def gemv(bits, rows, bn, bk, warps, split):
        ptrs = dict(x_ptr="bf16", qweight_ptr="i32", scales_ptr="bf16", zeros_ptr="bf16",
                    y_ptr="bf16" if split == 1 else "fp32")  # fmt: skip
        const = dict(BITS=bits, TILE_IN_ONE_GROUP=True, ROWS=rows, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split)
        return quant_gemv_kernel, ptrs, const, 90, dict(num_warps=warps, num_stages=1)

    def fp8(arch, dt, mode, bm, bn, bk, warps):
        ptrs = dict(x_ptr=dt, w_ptr="u8", scale_ptr="fp32", y_ptr=dt)
        const = dict(SCALE_MODE=mode, BN=128, BK=128, PRECISION="tf32", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
        return fp8_matmul_kernel, ptrs, const, arch, dict(num_warps=warps, num_stages=3)

    def decode(split: bool):
        # NOTE: split: partial results in float32, merged by the last split in the same launch (atomics)
        ptrs = dict(query_ptr="bf16", key_cache_ptr="bf16", value_cache_ptr="bf16", block_tables_ptr="i32",
                    context_lens_ptr="i32", out_ptr="fp32" if split else "bf16", lse_ptr="fp32", final_ptr="bf16",
                    counter_ptr="i32")  # fmt: skip
        const = dict(QUERIES_PER_KV=4, KV_QUANT=0, block_size=16, DIRECT_OUT=not split, SOFTCAP=False,
                     DOT_PRECISION="tf32", BLOCK_G=16, BLOCK_N=64, BLOCK_D=128)  # fmt: skip
        return paged_decode_attention_kernel, ptrs, const, 90, dict(num_warps=4)

    norm_ptrs = dict(x_ptr="bf16", residual_ptr="bf16", weight_ptr="bf16", out_ptr="bf16")
    rot_ptrs = dict(q_ptr="bf16", k_ptr="bf16", cos_ptr="fp32", sin_ptr="fp32", positions_ptr="i64")
    act_ptrs = dict(gate_ptr="bf16", up_ptr="bf16", out_ptr="bf16")
    return {
        "w4a16-decode": quant("bf16", 4, False, 16, 32, 128, 4, 4),
        "w4a16-decode-split-k": quant("bf16", 4, False, 16, 64, 128, 4, 4, split=4),
        "split-k-sum": (
            split_k_sum_kernel,
            dict(partials_ptr="fp32", y_ptr="bf16"),
            dict(SPLIT_K=4, BLOCK=1024),
            90,
            dict(num_warps=4),
        ),  # fmt: skip
        "w4a16-gemv": gemv(4, 1, 64, 256, 4, 2),
        "fp8-quantize-per-token": (
            quantize_per_token_kernel,
            dict(x_ptr="bf16", q_ptr="fp8e4nv", scale_ptr="fp32"),
            dict(BLOCK_K=1024),
            90,
            dict(num_warps=4),
        ),  # fmt: skip
        "w8a16-prefill-act-order": quant("fp16", 8, True, 128, 128, 64, 8, 3),
        "fp8-block-sm80": fp8(80, "bf16", 2, 16, 64, 128, 4),
        "fp8-channel-sm90": fp8(90, "fp16", 1, 128, 128, 64, 8),
        "add-rms-norm-gemma": (
            rms_norm_kernel,
            norm_ptrs,
            dict(HAS_RESIDUAL=True, GEMMA=True, BLOCK=4096),
            90,
            dict(num_warps=16),
        ),  # fmt: skip
        "rotary-gptj": (
            rotary_embedding_kernel,
            rot_ptrs,
            dict(HALF=64, IS_NEOX=False, BLOCK_H=16, BLOCK_P=64),
            90,
            dict(num_warps=4),
        ),  # fmt: skip
        "gelu-tanh-and-mul": (act_and_mul_kernel, act_ptrs, dict(ACT=2, BLOCK=1024), 90, dict(num_warps=4)),
        "decode-split-merge": decode(True),
        "decode-direct": decode(False),
    }


def compile_all() -> None:
    """Compile every case and print one line each: ``ok NAME SHARED_BYTES`` or ``FAIL NAME ERROR``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for name, (fn, ptrs, const, arch, options) in _cases().items():
        sig = {a: "constexpr" if a in const else "*" + ptrs[a] if a in ptrs else "fp32" if a in FLOATS else "i32"
               for a in fn.arg_names}  # fmt: skip
        try:
            src = ASTSource(fn=fn, signature=sig, constexprs=const)
            kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
            print(f"ok {name} {arch} {kernel.metadata.shared}", flush=True)
        except Exception as err:  # noqa: BLE001 - reported to the test, which fails on it
            print(f"FAIL {name} {type(err).__name__}: {err}".replace("\n", " ")[:2000], flush=True)


def print_gemv_loop_conversions() -> None:
    """Compile each gemv block of the sweep for sm90 at 1 and GEMV_MAX_ROWS rows, as the JIT
    would see contiguous tensors (unit strides as constants, 16-byte aligned pointers and rows);
    print ``converts NAME COUNT`` with the layout conversions inside the K loop."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from benchmarks.gpu_quant_linear import GEMV_SWEEP_BLOCKS
    from pagedllm.kernels.quant_gemv import GEMV_MAX_ROWS
    from pagedllm.kernels.quant_gemv import quant_gemv_kernel as fn

    ptrs = dict(x_ptr="bf16", qweight_ptr="i32", scales_ptr="bf16", zeros_ptr="bf16", y_ptr="fp32")
    aligned = {*ptrs, "stride_xm", "stride_qk", "stride_sg", "stride_zg", "stride_ys", "stride_ym", "N", "K"}
    for (bn, bk, warps), rows in ((b, r) for b in GEMV_SWEEP_BLOCKS for r in (1, GEMV_MAX_ROWS)):
        const = dict(BITS=4, TILE_IN_ONE_GROUP=128 % bk == 0, ROWS=rows, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=4,
                     stride_xk=1, stride_qn=1, stride_sn=1, stride_zn=1, stride_yn=1)  # fmt: skip
        sig = {a: "constexpr" if a in const else "*" + ptrs[a] if a in ptrs else "i32" for a in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in aligned}
        src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
        ttgir = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)).asm["ttgir"]
        loop = ttgir.split("scf.for", 1)[1].split("scf.yield", 1)[0]
        print(f"converts m{rows}-n{bn}-k{bk}-w{warps} {loop.count('ttg.convert_layout')}", flush=True)


def _ptxas_available() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.slow
@pytest.mark.skipif(not _ptxas_available(), reason="needs Triton's NVIDIA backend (its bundled ptxas)")
def test_new_kernels_compile_for_hopper_and_the_fp8_fallback_for_ampere():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=600, env=env)
    lines = [line for line in result.stdout.splitlines() if line.startswith(("ok ", "FAIL "))]
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(lines) == 13, result.stdout + result.stderr[-3000:]
    failures = [line for line in lines if line.startswith("FAIL")]
    assert not failures, "\n".join(failures)
    for line in lines:
        _, name, arch, shared = line.split()
        assert int(shared) <= SHARED_LIMIT[int(arch)], line


@pytest.mark.slow
@pytest.mark.skipif(not _ptxas_available(), reason="needs Triton's NVIDIA backend (its bundled ptxas)")
def test_gemv_candidates_compile_without_a_layout_conversion_in_the_loop():
    # NOTE: the property the gemv kernel exists for, and the interpreter cannot see it: a trip that
    # converts a layout goes through shared memory between barriers
    from benchmarks.gpu_quant_linear import GEMV_SWEEP_BLOCKS

    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, __file__, "gemv"], capture_output=True, text=True, timeout=600, env=env,
                            cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    counts = dict(line.split()[1:] for line in result.stdout.splitlines() if line.startswith("converts "))
    assert len(counts) == 2 * len(GEMV_SWEEP_BLOCKS), result.stdout
    assert set(counts.values()) == {"0"}, counts


if __name__ == "__main__":
    print_gemv_loop_conversions() if sys.argv[1:] == ["gemv"] else compile_all()
