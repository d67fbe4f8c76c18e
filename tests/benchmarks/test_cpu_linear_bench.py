"""The linear-layer benchmark measures the projections the engine really runs for a shape."""

from __future__ import annotations

from benchmarks.cpu_linear import layer_shapes


def test_a_layers_projections_are_the_fused_ones_of_the_shape():
    # NOTE: Qwen2.5-0.5B: 14 query heads and 2 KV heads of 64, intermediate 4864
    assert layer_shapes("qwen2.5-0.5b") == {
        "qkv": (1152, 896),
        "o": (896, 896),
        "gate_up": (9728, 896),
        "down": (896, 4864),
    }
    assert layer_shapes("llama-3.2-1b")["qkv"] == (3072, 2048)  # 32 + 2 * 8 heads of 64
