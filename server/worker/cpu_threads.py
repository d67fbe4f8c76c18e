"""How many threads torch should use on CPU: the cores this process may actually run on.

A container sees every core of its node in ``os.cpu_count()``, but its CPU quota (cgroup
``cpu.max``) may allow far fewer; OpenMP spinning on more threads than that makes every
step many times slower. So the thread count is the smallest of the CPU affinity and the
quota (rounded down, at least 1), unless ``--cpu-threads`` or ``OMP_NUM_THREADS`` says
otherwise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str
    """Where the number came from, for the start-up log."""


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cpu_quota(root: str = CGROUP_ROOT) -> float | None:
    """CPUs the cgroup quota allows (cgroup v2 ``cpu.max``, else v1 CFS files); None if unlimited."""
    v2 = _read(os.path.join(root, "cpu.max"))
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        if quota == "max" or not period:
            return None
        return int(quota) / int(period)
    quota_us = _read(os.path.join(root, "cpu", "cpu.cfs_quota_us")) or _read(os.path.join(root, "cpu.cfs_quota_us"))
    period_us = _read(os.path.join(root, "cpu", "cpu.cfs_period_us")) or _read(os.path.join(root, "cpu.cfs_period_us"))
    if quota_us is None or period_us is None or int(quota_us) <= 0:
        return None
    return int(quota_us) / int(period_us)


def affinity() -> int:
    """CPUs this process may be scheduled on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def choose_threads(
    flag: int | None, environ: dict[str, str] | None = None, root: str = CGROUP_ROOT, ranks: int = 1
) -> ThreadChoice:
    """The intra-op thread count: the flag, else ``OMP_NUM_THREADS``, else what the CPU quota allows,
    shared among ``ranks`` tensor-parallel processes on the same CPUs."""
    env = os.environ if environ is None else environ
    if flag is not None:
        return ThreadChoice(flag, "--cpu-threads")
    if env.get("OMP_NUM_THREADS", "").strip().isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return ThreadChoice(int(env["OMP_NUM_THREADS"]), "OMP_NUM_THREADS")
    cores = affinity()
    quota = cpu_quota(root)
    share = f", shared by {ranks} ranks" if ranks > 1 else ""
    if quota is not None and quota < cores:
        return ThreadChoice(max(1, int(quota) // ranks), f"cgroup CPU quota of {quota:g} (affinity {cores}){share}")
    return ThreadChoice(max(1, cores // ranks), f"CPU affinity{share}")
