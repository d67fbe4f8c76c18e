"""Aligned buffers for packed weights (kernels/_cpu_memory.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pagedllm.kernels import _cpu_memory, bf16_gemm_cpu
from pagedllm.kernels._cpu_memory import HUGE_MIN_BYTES, HUGE_PAGE, aligned_empty


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    flags: list[str] | None = None
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(part, 16) for part in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    assert flags is not None, f"no mapping holds {address:#x}"
    return flags


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8, torch.float32])
@pytest.mark.parametrize("numel", [1, 1000, HUGE_MIN_BYTES])
def test_aligned_and_sized(numel, dtype):
    out = aligned_empty(numel, dtype)
    assert out.shape == (numel,) and out.dtype == dtype and out.is_contiguous()
    align = HUGE_PAGE if out.numel() * out.element_size() >= HUGE_MIN_BYTES and _cpu_memory.huge_pages_enabled() else 64
    assert out.data_ptr() % align == 0
    out.fill_(1)  # writable over its whole length
    assert int(out.to(torch.float64).sum()) == numel


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage").exists(), reason="a Linux kernel with transparent huge pages"
)
def test_large_buffer_is_advised_for_huge_pages():
    out = aligned_empty(HUGE_MIN_BYTES // 2, torch.bfloat16)
    assert out.data_ptr() % HUGE_PAGE == 0
    assert "hg" in _vm_flags(out.data_ptr())  # MADV_HUGEPAGE given on its range


@pytest.mark.skipif(sys.platform != "linux", reason="the advice is Linux's")
def test_switch_off(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "0")
    assert not _cpu_memory.huge_pages_enabled()
    out = aligned_empty(HUGE_MIN_BYTES, torch.uint8)
    assert out.data_ptr() % 64 == 0 and "hg" not in _vm_flags(out.data_ptr())


@pytest.mark.skipif(sys.platform != "linux", reason="the advice is Linux's")
def test_packed_bf16_weight_uses_it():
    weight = torch.randn(2048, 1024).to(torch.bfloat16)  # 4 MiB
    packed = bf16_gemm_cpu.pack(weight)
    assert packed.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(bf16_gemm_cpu.unpack(packed), weight)
