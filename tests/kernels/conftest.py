"""Kernel-test fixtures: a fresh random seed per test, printed so a failure can be rerun.

Rerun a failure with its printed seed: ``PAGEDLLM_TEST_SEED=<seed> pytest tests/kernels -k <test>``.
"""

import os
import random

import pytest
import torch


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("PAGEDLLM_TEST_SEED", random.randrange(2**31)))
    print(f"seed={value} (rerun with PAGEDLLM_TEST_SEED={value})")
    torch.manual_seed(value)
    return value
