"""Test-wide settings: Triton kernels run through the interpreter when no GPU is present.

NOTE: Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. at import of the
kernel module, so it must be set before anything imports ``pagedllm.kernels``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
