"""An AWQ checkpoint of a benchmark shape, so our engine and vLLM run the very same 4-bit weights.

The shape's random model (:func:`benchmarks.model_shapes.write_random_model`) is written
first; then every projection of every layer (q/k/v/o, gate/up/down) is quantized to 4 bits
with one scale and zero point per ``--group`` inputs and stored in AutoAWQ's GEMM layout
(``qweight``/``qzeros`` int32 packed 8 per word along the outputs in the order
0, 2, 4, 6, 1, 3, 5, 7; ``scales`` float16), with ``quantization_config`` in config.json.
Embeddings, norms and the LM head stay as they are, as AutoAWQ leaves them.

    python -m benchmarks.quant_checkpoint qwen2.5-0.5b /tmp/qwen-0.5b-awq
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import torch

from benchmarks.common import HelpFormatter
from benchmarks.model_shapes import SHAPES, write_random_model

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def awq_quantize(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """``w`` [N, K] as AWQ's qweight [K, N / 8], qzeros [K / group, N / 8] and scales [K / group, N]."""
    n, k = w.shape
    cols = w.float().T.reshape(k // group, group, n)  # [groups, group, N]
    lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-6).half()
    zeros = torch.round(-lo / scales.float()).clamp(0, 15)
    q = torch.round(cols / scales.float()[:, None] + zeros[:, None]).clamp(0, 15).reshape(k, n)
    return {"qweight": _pack(q), "qzeros": _pack(zeros), "scales": scales}


def _pack(v: torch.Tensor) -> torch.Tensor:
    """[rows, N] levels -> int32 [rows, N / 8] in AWQ's order."""
    v = v.to(torch.int64)
    words = sum(v[:, AWQ_ORDER[i] :: 8] << (4 * i) for i in range(8))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def write_awq_model(path: str, shape: str, group: int | None = None, dtype: str = "bfloat16") -> int:
    """Save ``shape`` with random weights to ``path`` as an AWQ checkpoint; its parameter count (unquantized).

    ``group``: inputs per scale; default the largest of 128, 64, 32 that divides the shape's widths.
    """
    from safetensors.torch import load_file, save_file

    widths = (SHAPES[shape]["hidden_size"], SHAPES[shape]["intermediate_size"])
    group = group or next(g for g in (128, 64, 32) if all(w % g == 0 for w in widths))
    count = write_random_model(path, shape, dtype)
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        state = load_file(file)
        out = {}
        for name, tensor in state.items():
            module, _, leaf = name.rpartition(".")
            if leaf == "weight" and module.rpartition(".")[2] in PROJECTIONS:
                out.update({f"{module}.{k}": v.contiguous() for k, v in awq_quantize(tensor, group).items()})
            else:
                out[name] = tensor
        save_file(out, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return count


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.quant_checkpoint", description=__doc__, formatter_class=HelpFormatter
    )
    p.add_argument("shape", choices=sorted(SHAPES), help="model shape")
    p.add_argument("path", help="directory to write the checkpoint to")
    p.add_argument(
        "--group", type=int, default=None, choices=(32, 64, 128), help="inputs per scale (default: 128 if it divides)"
    )
    p.add_argument(
        "--dtype", default="bfloat16", choices=("float16", "bfloat16", "float32"), help="unquantized tensors"
    )
    args = p.parse_args(argv)
    print(f"{write_awq_model(args.path, args.shape, args.group, args.dtype)} parameters (before quantization)")


if __name__ == "__main__":
    main()
