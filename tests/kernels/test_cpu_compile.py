"""What every C kernel shares (kernels/_cpu_compile.py): one switch keeps them all off."""

from __future__ import annotations

import pytest

from pagedllm.kernels import bf16_gemm_cpu, decode_scores_cpu, prefill_attention_cpu, w4_gemm_cpu

KERNELS = [bf16_gemm_cpu, w4_gemm_cpu, decode_scores_cpu, prefill_attention_cpu]


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda m: m.__name__)
def test_switched_off_by_the_environment(monkeypatch, kernel):
    monkeypatch.setenv("PAGEDLLM_CPU_GEMM", "0")
    kernel.available.cache_clear()
    try:
        assert not kernel.available()
    finally:
        monkeypatch.delenv("PAGEDLLM_CPU_GEMM")
        kernel.available.cache_clear()
