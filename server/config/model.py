"""Which model runs, and how: weights, dtype, device, attention backend, pooling."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.server.config.checks import check_choice, check_range, field_help

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")
ATTENTION_BACKENDS = ("auto", "numba", "torch", "triton")
QUANTIZATIONS = ("awq", "gptq", "compressed-tensors", "fp8", "int8")
"""``--quantization``: the checkpoint's own method (checked against its config) or fp8 / int8 at load."""
POOLING_TYPES = ("last", "mean")
"""Embedding pooling: ``last`` takes the last prompt token's final hidden state (vLLM's default for
``*ForCausalLM`` used as embedding models), ``mean`` averages every prompt position's."""


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = field(
        default=None, metadata=field_help("Hugging Face model directory (default: the embedded demo model).")
    )
    tokenizer: str | None = field(
        default=None, metadata=field_help("Tokenizer directory; defaults to the model directory.")
    )
    dtype: str = field(
        default="auto",
        metadata=field_help(
            "Weight and activation dtype; auto = the checkpoint's (on CPU: bfloat16 for 16-bit "
            "checkpoints where the CPU has AVX-512-BF16, AMX or AVX2 and FMA, else float32).",
            choices=DTYPES,
        ),
    )
    device: str = field(
        default="auto", metadata=field_help("Where the model runs; auto picks cuda when available.", choices=DEVICES)
    )
    max_model_len: int | None = field(
        default=None, metadata=field_help("Longest prompt plus output, in tokens; defaults to the model's limit.")
    )
    load_format: str = field(
        default="auto",
        metadata=field_help("Weight format; dummy draws random weights (benchmarks).", choices=LOAD_FORMATS),
    )
    quantization: str | None = field(
        default=None,
        metadata=field_help(
            "Quantized weights: the checkpoint's quant_method (default: read from its config), or fp8 / int8 to "
            "quantize a plain checkpoint per channel at load.",
            choices=(None, *QUANTIZATIONS),
        ),
    )
    seed: int = field(default=0, metadata=field_help("Seed for random weights and unseeded sampling."))
    skip_tokenizer_init: bool = field(
        default=False, metadata=field_help("Do not load a tokenizer; prompts must be token ids.")
    )
    attention_backend: str = field(
        default="auto",
        metadata=field_help(
            "Attention implementation; auto = triton on CUDA, numba on CPU (torch where numba is missing).",
            choices=ATTENTION_BACKENDS,
        ),
    )
    enforce_eager: bool = field(
        default=False,
        metadata=field_help(
            "On CUDA, run every step eagerly: no CUDA graphs of the decode step (they take memory and start-up time)."
        ),
    )
    pooling_type: str | None = field(
        default=None,
        metadata=field_help(
            "How /v1/embeddings pools hidden states: last or mean; default: the model's sentence-transformers"
            " 1_Pooling/config.json if it has one, else last.",
            choices=(None, *POOLING_TYPES),
        ),
    )

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("device", self.device, DEVICES)
        check_choice("load_format", self.load_format, LOAD_FORMATS)
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        check_range("max_model_len", self.max_model_len, 1)
        check_choice("pooling_type", self.pooling_type, (None, *POOLING_TYPES))
        check_choice("quantization", self.quantization, (None, *QUANTIZATIONS))
