"""Write a LLaMA-7B-shaped model directory for GPU runs: its config and a 32,000-token BPE
tokenizer, no weights (serve it with ``--load-format dummy``), or with ``--weights`` random
bf16 weights too (what ``transformers`` needs to run the same model).

    python -m benchmarks.llama7b /tmp/llama7b                # config + tokenizer
    python -m benchmarks.llama7b /tmp/llama7b --weights      # + random bf16 safetensors (~13.5 GB)
    pagedllm serve /tmp/llama7b --load-format dummy --dtype bfloat16

The tokenizer is the demo model's byte-level BPE trained on the standard library's
documentation; where that text yields fewer than 32,000 tokens, placeholder tokens fill the
rest, so every id the random model can emit decodes to some text.
"""

from __future__ import annotations

import argparse

from benchmarks.common import HelpFormatter
from benchmarks.model_shapes import SHAPES


def write_llama7b(path: str, weights: bool = False, device: str = "cuda", shape: str = "llama-7b") -> int:
    """Write the model (a LLaMA of ``shape``, LLaMA-7B by default) to ``path``; its parameter
    count (0 without ``weights``: config and tokenizer only)."""
    from transformers import LlamaConfig

    from benchmarks.model_shapes import write_tokenizer

    fields = SHAPES[shape]
    config = LlamaConfig(**fields, bos_token_id=0, eos_token_id=1, pad_token_id=2, dtype="bfloat16")
    config.architectures = ["LlamaForCausalLM"]  # NOTE: a config saved without a model names none
    config.save_pretrained(path)
    write_tokenizer(path, fields["vocab_size"], fields["max_position_embeddings"])
    if weights:
        import torch
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(path, safe_serialization=True)
        return sum(p.numel() for p in model.parameters())
    return 0  # NOTE: no weights written


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llama7b", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("path", help="directory to write")
    p.add_argument("--weights", action="store_true", help="also random bf16 weights (safetensors)")
    p.add_argument("--device", default="cuda", help="where the random weights are drawn (default: cuda)")
    args = p.parse_args(argv)
    write_llama7b(args.path, args.weights, args.device)
    print(f"wrote a LLaMA-7B-shaped model to {args.path}" + (" with random bf16 weights" if args.weights else ""))


if __name__ == "__main__":
    main()
