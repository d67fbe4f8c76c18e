"""Model shapes for the benchmarks: the small test LLaMA, and the real sizes people serve.

Each shape is a ``transformers`` config; :func:`write_random_model` saves it with random
weights (normal(0, 0.02), seeded: always the same weights) in the dtype asked for, so that
our engine, vLLM and ``transformers`` load the very same checkpoint. ``--model PATH`` runs
a local checkpoint instead (:func:`model_vocab` reads its vocabulary for the workload).

    python -m benchmarks.model_shapes qwen2.5-0.5b /tmp/qwen-0.5b   # write one, to reuse it
"""

from __future__ import annotations

import argparse
import json
import os

from benchmarks.common import HelpFormatter
from benchmarks.paper_setting import LLAMA_7B

BENCH_LLAMA = dict(
    vocab_size=8000,
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=2048,
)
"""The 33.5M-parameter LLaMA of the earlier rounds (per-op overhead dominates its steps)."""

QWEN2_5_0_5B = dict(
    architecture="Qwen2ForCausalLM",
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
QWEN2_5_1_5B = QWEN2_5_0_5B | dict(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2
)
LLAMA_3_2_1B = dict(
    architecture="LlamaForCausalLM",
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
SHAPES: dict[str, dict] = {
    "bench": BENCH_LLAMA,
    "qwen2.5-0.5b": QWEN2_5_0_5B,
    "qwen2.5-1.5b": QWEN2_5_1_5B,
    "llama-3.2-1b": LLAMA_3_2_1B,
    "llama-7b": LLAMA_7B,
}
"""Shape name -> config fields (``architecture`` picks the ``transformers`` class; LLaMA by default)."""


def shape_config(shape: str):
    """The ``transformers`` model class of ``shape`` and its config."""
    import transformers

    fields = dict(SHAPES[shape])
    cls = getattr(transformers, fields.pop("architecture", "LlamaForCausalLM"))
    return cls, cls.config_class(**fields, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def write_random_model(path: str, shape: str, dtype: str = "bfloat16", device: str = "cpu") -> int:
    """Save ``shape`` with random weights in ``dtype`` to ``path``; its parameter count."""
    import torch

    cls, config = shape_config(shape)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # NOTE: drawn in the target dtype: no fp32 copy of a 1B model
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def model_vocab(path: str) -> int:
    """The vocabulary size of the checkpoint in ``path`` (its ``config.json``)."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.model_shapes", description=__doc__, formatter_class=HelpFormatter
    )
    p.add_argument("shape", choices=sorted(SHAPES), help="model shape")
    p.add_argument("path", help="directory to write")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="weights' dtype")
    args = p.parse_args(argv)
    params = write_random_model(args.path, args.shape, args.dtype)
    print(f"wrote {args.shape} ({params / 1e6:.1f}M parameters, {args.dtype}) to {args.path}")


if __name__ == "__main__":
    main()
