"""torch's thread count follows the CPU quota the process really has (emulated cgroup files)."""

from __future__ import annotations

import pytest

from pagedllm.server.worker import cpu_threads
from pagedllm.server.worker.cpu_threads import choose_threads, cpu_quota


@pytest.fixture
def many_cores(monkeypatch):
    monkeypatch.setattr(cpu_threads, "affinity", lambda: 16)


def cgroup_v2(tmp_path, cpu_max: str) -> str:
    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    return str(tmp_path)


def cgroup_v1(tmp_path, quota_us: int, period_us: int = 100000) -> str:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(f"{period_us}\n")
    return str(tmp_path)


@pytest.mark.parametrize(
    "cpu_max, threads",
    [("200000 100000", 2), ("150000 100000", 1), ("50000 100000", 1), ("400000 50000", 8), ("max 100000", 16)],
)
def test_cgroup_v2_quota(tmp_path, many_cores, cpu_max, threads):
    choice = choose_threads(None, environ={}, root=cgroup_v2(tmp_path, cpu_max))
    assert choice.threads == threads


def test_cgroup_v1_quota(tmp_path, many_cores):
    root = cgroup_v1(tmp_path, 300000)
    assert cpu_quota(root) == 3.0
    assert choose_threads(None, environ={}, root=root).threads == 3
    (tmp_path / "unlimited").mkdir()
    assert cpu_quota(cgroup_v1(tmp_path / "unlimited", -1)) is None


def test_no_cgroup_files_means_the_affinity(tmp_path, many_cores):
    assert choose_threads(None, environ={}, root=str(tmp_path)).threads == 16


def test_the_flag_and_omp_num_threads_win(tmp_path, many_cores):
    root = cgroup_v2(tmp_path, "100000 100000")
    assert choose_threads(6, environ={"OMP_NUM_THREADS": "3"}, root=root).threads == 6
    assert choose_threads(None, environ={"OMP_NUM_THREADS": "3"}, root=root).threads == 3
    assert choose_threads(None, environ={"OMP_NUM_THREADS": "junk"}, root=root).threads == 1


def test_the_engine_applies_the_choice(tiny_llama):
    import torch

    from pagedllm.server import LLM

    before = torch.get_num_threads()
    try:
        llm = LLM(model=tiny_llama, cpu_threads=1, num_gpu_blocks_override=64)
        assert torch.get_num_threads() == 1 and llm.llm_engine.runner.threads.reason == "--cpu-threads"
    finally:
        torch.set_num_threads(before)
