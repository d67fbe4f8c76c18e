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
QWEN2_5_7B = QWEN2_5_0_5B | dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    tie_word_embeddings=False,
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
LLAMA_7B = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=2048,
)
"""The paper's LLaMA-7B (its GPU setting)."""
LLAMA_3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
)
"""LLaMA-3-8B (GQA 32/8): the shape of the GPU summary (``benchmarks.gpu_quick``)."""
SHAPES: dict[str, dict] = {
    "bench": BENCH_LLAMA,
    "qwen2.5-0.5b": QWEN2_5_0_5B,
    "qwen2.5-1.5b": QWEN2_5_1_5B,
    "qwen2.5-7b": QWEN2_5_7B,
    "llama-3.2-1b": LLAMA_3_2_1B,
    "llama-7b": LLAMA_7B,
    "llama-3-8b": LLAMA_3_8B,
}
"""Shape name -> config fields (``architecture`` picks the ``transformers`` class; LLaMA by default)."""


def shape_config(shape: str):
    """The ``transformers`` model class of ``shape`` and its config."""
    import transformers

    fields = dict(SHAPES[shape])
    cls = getattr(transformers, fields.pop("architecture", "LlamaForCausalLM"))
    return cls, cls.config_class(**fields, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def write_random_model(
    path: str, shape: str, dtype: str = "bfloat16", device: str = "cpu", tokenizer: bool = False
) -> int:
    """Save ``shape`` with random weights in ``dtype`` to ``path``; its parameter count.
    ``tokenizer``: also a tokenizer of the model's vocabulary (:func:`write_tokenizer`), for
    servers and clients that speak text."""
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
    if tokenizer:
        write_tokenizer(path, config.vocab_size, min(config.max_position_embeddings, 32768))
    return sum(p.numel() for p in model.parameters())


def save_random_llama(path: str, tokenizer: bool = False) -> int:
    """The small LLaMA of the earlier rounds (:data:`BENCH_LLAMA`) in float32, as
    :func:`write_random_model` writes any shape; its parameter count."""
    return write_random_model(path, "bench", "float32", tokenizer=tokenizer)


def write_tokenizer(path: str, vocab: int, max_length: int) -> None:
    """A byte-level BPE trained on the standard library's documentation, with placeholder tokens
    (``<unused_N>``) after its own up to ``vocab``, so every id a random model emits decodes to
    some text and that text encodes back to the same id. Ids 0, 1, 2 are <s>, </s>, <pad>."""
    from pydoc_data.topics import topics

    from pagedllm.server.demo.train import train_tokenizer

    tok = train_tokenizer([topics[k] for k in sorted(topics)], vocab)
    if len(tok) < vocab:
        tok.add_tokens([f"<unused_{i}>" for i in range(vocab - len(tok))])
    if len(tok) != vocab:
        raise RuntimeError(f"the tokenizer has {len(tok)} tokens, not the model's {vocab}")
    tok.model_max_length = max_length
    # NOTE: loaders that pick the tokenizer class by the model's family (Qwen2's) would otherwise
    # add their own unknown token past the vocabulary, an id the model cannot take.
    tok.unk_token = "<pad>"
    tok.save_pretrained(path)


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
