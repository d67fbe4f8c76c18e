"""What every C kernel shares (kernels/_cpu_compile.py): one switch keeps them all off, and a
header a source includes is part of its build."""

from __future__ import annotations

import ctypes
import shutil

import pytest

from pagedllm.kernels import _cpu_compile, bf16_gemm_cpu, decode_scores_cpu, prefill_attention_cpu, w4_gemm_cpu

KERNELS = [bf16_gemm_cpu, w4_gemm_cpu, decode_scores_cpu, prefill_attention_cpu]


def forget(kernel) -> None:
    """Clear what the kernel's module cached about this CPU (the bf16 GEMM caches its variants)."""
    for name in ("available", "isa", "runs", "int8_isa", "int8_runs"):
        cached = getattr(kernel, name, None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda m: m.__name__)
def test_switched_off_by_the_environment(monkeypatch, kernel):
    monkeypatch.setenv("PAGEDLLM_CPU_GEMM", "0")
    forget(kernel)
    try:
        assert not kernel.available()
    finally:
        monkeypatch.delenv("PAGEDLLM_CPU_GEMM")
        forget(kernel)


@pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "clang")), reason="needs a C compiler")
def test_a_header_beside_the_source_is_part_of_its_build(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    source, header = tmp_path / "probe.c", tmp_path / "_probe.h"
    source.write_text('#include "_probe.h"\nint probe_value(void) { return VALUE; }\n')
    values = {}
    for value in (3, 4):
        header.write_text(f"#define VALUE {value}\n")
        path = _cpu_compile.build_library(source, ("-O1", "-shared", "-fPIC"))
        assert path is not None
        values[path] = ctypes.CDLL(str(path)).probe_value()
    assert sorted(values.values()) == [3, 4]  # a changed header built a library of its own
    header.unlink()
    assert _cpu_compile.build_library(source, ("-O1", "-shared", "-fPIC")) is None  # a missing header: no kernel
