"""What every benchmark program shares: help that shows defaults, and a sane torch thread count."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every flag's default after its help."""


def set_threads(flag: int | None = None) -> int:
    """torch's intra-op threads: ``flag`` if given, else from the CPUs this process may use
    (cgroup quota, affinity, ``OMP_NUM_THREADS``); printed, so two busy processes do not
    oversubscribe the cores unnoticed."""
    import torch

    from pagedllm.server.worker.cpu_threads import choose_threads

    choice = choose_threads(flag)
    torch.set_num_threads(choice.threads)
    print(f"torch threads: {choice.threads} ({choice.reason})")
    return choice.threads
