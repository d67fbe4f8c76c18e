"""The benchmarks' AWQ writer stores what the engine reads back: levels within a step of the weights."""

from __future__ import annotations

import torch

from benchmarks.quant_checkpoint import awq_quantize
from pagedllm.server.config.quantization import QuantConfig
from pagedllm.server.worker.quantization import awq


def test_awq_writer_round_trips_through_the_engines_reader():
    w = torch.randn(96, 256) * 0.05
    tensors = awq_quantize(w, group=64)
    assert tensors["qweight"].shape == (256, 12) and tensors["scales"].shape == (4, 96)
    back = awq.to_weight(QuantConfig("awq", "awq", 4, 64, sym=False), tensors).dequantize()
    step = tensors["scales"].float().T.repeat_interleave(64, dim=1)
    err = (back - w).abs() / step  # NOTE: half a step, a whole one where a rounded zero point clamps the top level
    assert err.max() <= 1 + 1e-4 and err.mean() < 0.3
