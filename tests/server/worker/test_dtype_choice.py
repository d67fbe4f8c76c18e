"""choose_dtype: the dtype asked for, or the checkpoint's as far as the machine runs it fast."""

from __future__ import annotations

import pytest
import torch

from pagedllm.server.worker.dtype_choice import choose_dtype, cpu_bf16_flags

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
ZEN4_FLAGS = "fpu vme sse sse2 avx avx2 avx512f avx512bw avx512vl avx512_bf16 avx512_vnni"
SAPPHIRE_RAPIDS_FLAGS = "fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8"
ICE_LAKE_FLAGS = "fpu sse avx2 avx512f avx512bw avx512vl avx512_vnni"  # AVX-512, but no bf16 units
ZEN3_FLAGS = "fpu sse avx avx2 fma"  # AVX2 only


def no_gemm() -> None:
    """The engine's bf16 GEMM runs in no variant (no compiler, no Numba, or a CPU without AVX2)."""
    return None


def avx2_gemm() -> str:
    return "avx2"


def fake_cpuinfo(tmp_path, flags: str) -> str:
    """A /proc/cpuinfo of two processors with these flags."""
    path = tmp_path / "cpuinfo"
    path.write_text(
        "".join(
            f"processor\t: {n}\nvendor_id\t: SomeVendor\nmodel name\t: CPU\nflags\t\t: {flags}\nbogomips\t: 1.0\n\n"
            for n in range(2)
        )
    )
    return str(path)


def test_bf16_flags_are_read_from_cpuinfo(tmp_path):
    assert cpu_bf16_flags(fake_cpuinfo(tmp_path, ZEN4_FLAGS)) == ["avx512_bf16"]
    assert cpu_bf16_flags(fake_cpuinfo(tmp_path, SAPPHIRE_RAPIDS_FLAGS)) == ["amx_bf16", "avx512_bf16"]
    assert cpu_bf16_flags(fake_cpuinfo(tmp_path, ICE_LAKE_FLAGS)) == []
    assert cpu_bf16_flags(str(tmp_path / "absent")) == []  # not Linux: no bf16 assumed


def test_a_flag_name_inside_another_word_does_not_count(tmp_path):
    assert cpu_bf16_flags(fake_cpuinfo(tmp_path, "avx512_bf16x amx_bf16_beta")) == []


@pytest.mark.parametrize(
    ("stored", "flags", "gemm", "expected"),
    [
        ("bfloat16", ZEN4_FLAGS, no_gemm, torch.bfloat16),
        ("bfloat16", SAPPHIRE_RAPIDS_FLAGS, no_gemm, torch.bfloat16),
        ("bfloat16", ICE_LAKE_FLAGS, no_gemm, torch.float32),
        ("bfloat16", ICE_LAKE_FLAGS, avx2_gemm, torch.bfloat16),
        ("bfloat16", ZEN3_FLAGS, avx2_gemm, torch.bfloat16),
        ("bfloat16", ZEN3_FLAGS, no_gemm, torch.float32),
        ("float16", ZEN4_FLAGS, no_gemm, torch.bfloat16),
        ("float16", ICE_LAKE_FLAGS, no_gemm, torch.float32),
        ("float16", ZEN3_FLAGS, avx2_gemm, torch.bfloat16),
        ("float32", ZEN4_FLAGS, no_gemm, torch.float32),
        ("float32", ICE_LAKE_FLAGS, no_gemm, torch.float32),
        ("float32", ZEN3_FLAGS, avx2_gemm, torch.float32),
        (None, ZEN4_FLAGS, no_gemm, torch.float32),  # no dtype in the config: float32
        ("float64", ZEN4_FLAGS, no_gemm, torch.float32),
        ("float64", ZEN3_FLAGS, avx2_gemm, torch.float32),
    ],
)
def test_auto_on_cpu_follows_the_checkpoint_where_bf16_is_fast(tmp_path, stored, flags, gemm, expected):
    config = {} if stored is None else {"torch_dtype": stored}
    choice = choose_dtype("auto", config, CPU, cpuinfo=fake_cpuinfo(tmp_path, flags), gemm_isa=gemm)
    assert choice.dtype == expected
    assert choice.reason


def test_auto_asks_the_gemm_only_where_the_cpu_has_no_bf16_units(tmp_path):
    asked = []

    def gemm():
        asked.append(1)
        return "avx2"

    choose_dtype("auto", {"dtype": "bfloat16"}, CPU, fake_cpuinfo(tmp_path, ZEN4_FLAGS), gemm_isa=gemm)
    assert not asked
    choose_dtype("auto", {"dtype": "bfloat16"}, CPU, fake_cpuinfo(tmp_path, ZEN3_FLAGS), gemm_isa=gemm)
    assert asked


def test_the_reason_names_the_checkpoint_and_the_cpu_unit(tmp_path):
    zen4, ice_lake = fake_cpuinfo(tmp_path, ZEN4_FLAGS), str(tmp_path / "no-such-cpuinfo")
    assert choose_dtype("auto", {"dtype": "bfloat16"}, CPU, zen4).reason == (
        "the checkpoint's bfloat16, on a CPU with avx512_bf16"
    )
    assert choose_dtype("auto", {"dtype": "float16"}, CPU, zen4).reason == (
        "float16 checkpoint, run in bfloat16 on a CPU with avx512_bf16"
    )
    assert choose_dtype("auto", {"dtype": "bfloat16"}, CPU, ice_lake, gemm_isa=no_gemm).reason == (
        "bfloat16 checkpoint, but the CPU has no amx_bf16 or avx512_bf16 and no AVX2 bfloat16 GEMM"
    )
    assert choose_dtype("auto", {"dtype": "bfloat16"}, CPU, ice_lake, gemm_isa=avx2_gemm).reason == (
        "the checkpoint's bfloat16, on a CPU with avx2 (the engine's AVX2 bfloat16 GEMM)"
    )


def test_config_spellings_of_the_checkpoint_dtype(tmp_path):
    zen4 = fake_cpuinfo(tmp_path, ZEN4_FLAGS)
    assert choose_dtype("auto", {"dtype": "bfloat16"}, CPU, zen4).dtype == torch.bfloat16
    assert choose_dtype("auto", {"torch_dtype": "torch.bfloat16"}, CPU, zen4).dtype == torch.bfloat16


def test_an_explicit_dtype_is_used_on_any_cpu(tmp_path):
    ice_lake = fake_cpuinfo(tmp_path, ICE_LAKE_FLAGS)
    for name in ("bfloat16", "float16", "float32"):
        choice = choose_dtype(name, {"torch_dtype": "float32"}, CPU, ice_lake)
        assert choice.dtype == getattr(torch, name)
        assert choice.reason == "dtype asked for"


def test_auto_on_cuda_keeps_half_checkpoints_and_halves_float32(tmp_path):
    nothing = str(tmp_path / "absent")  # the CPU does not matter on CUDA
    assert choose_dtype("auto", {"torch_dtype": "float16"}, CUDA, nothing).dtype == torch.float16
    assert choose_dtype("auto", {"torch_dtype": "bfloat16"}, CUDA, nothing).dtype == torch.bfloat16
    assert choose_dtype("auto", {"torch_dtype": "float32"}, CUDA, nothing).dtype == torch.bfloat16
