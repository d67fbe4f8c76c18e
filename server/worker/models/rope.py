"""Rotary position embeddings (the "rotate half" layout of Hugging Face checkpoints).

The scaling variants a config can name, computed as ``transformers`` computes them:
``default``, ``linear``, ``dynamic`` (NTK), ``llama3``, ``yarn`` and ``longrope`` (Phi-3's
"su"), each optionally on only the first ``partial_rotary_factor`` of every head.

NOTE: a position's rotation depends on that position alone. The paged cache keeps K
already rotated, and a token is batched with tokens of other sequences, so nothing may
depend on the current sequence length, which is how ``transformers`` runs ``dynamic`` and
``longrope`` (it picks the frequencies from the longest position in the forward call):

    position p           0 .. trained-1               trained ..
    longrope             short_factor                  long_factor
    dynamic              plain frequencies             NTK base for a sequence of p + 1

(``trained`` is ``original_max_position_embeddings`` for longrope and
``max_position_embeddings`` for dynamic.) Any sequence no longer than ``trained`` is
rotated exactly as by ``transformers``, and so is every token it generates one at a time
past it (its step sees ``p + 1`` positions, ours too). We differ only where ``transformers``
prefills a prompt longer than ``trained`` in one call: it then rotates all of that
prompt, its first positions included, with the long frequencies; here those positions keep
the frequencies they had, so cached K never has to be rotated again. (vLLM instead fixes
dynamic NTK at the base for ``factor * max_position_embeddings`` tokens at every position,
which differs from ``transformers`` even for short sequences.)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from pagedllm.kernels import runs_on_triton
from pagedllm.kernels.rotary_cpu import rotary_cpu_
from pagedllm.kernels.rotary_embedding import rotary_embedding
from pagedllm.server.config import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
_LEGACY_NAMES = {"su": "longrope"}
_DEFAULT_THETA = 10000.0
# Types whose settings name the length the model was pretrained at.
_TRAINED_LENGTH_TYPES = ("llama3", "yarn", "longrope")


def rope_type(params: dict) -> str:
    """The variant ``params`` names, legacy spellings (``type``, ``su``) resolved."""
    name = params.get("rope_type") or params.get("type") or "default"
    if name == "yarn" and "long_factor" in params:
        name = "longrope"  # older Phi-3 configs call their LongRoPE lists "yarn"
    name = _LEGACY_NAMES.get(name, name)
    if name not in ROPE_TYPES:
        raise ConfigError("rope_type", name, f"choose one of {list(ROPE_TYPES)}", problem="is not supported")
    return name


def rotary_width(head_dim: int, params: dict) -> int:
    """How many leading dims of each head are rotated (an odd share is rounded up to pairs)."""
    return 2 * len(range(0, _frequency_dim(head_dim, params), 2))


def inverse_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    """Per-pair rotation frequencies at positions within the pretrained length: [pairs]."""
    return _trained_frequencies(_frequency_dim(head_dim, params), params)


def rotation_table(head_dim: int, max_positions: int, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) for every position below ``max_positions``: [max_positions, rotary_width].

    YaRN's and LongRoPE's attention factor is folded in, as ``transformers`` does.
    """
    freqs = _frequencies_by_position(_frequency_dim(head_dim, params), max_positions, params)
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = positions[:, None] * freqs  # [max_positions, pairs]
    emb = torch.cat((angles, angles), dim=-1)
    scale = _attention_factor(params)
    return emb.cos() * scale, emb.sin() * scale


def _frequency_dim(head_dim: int, params: dict) -> int:
    # transformers' `dim`: the exponent's denominator, before rounding up to whole pairs.
    partial = params.get("partial_rotary_factor")
    return int(head_dim * (1.0 if partial is None else float(partial)))


def _frequencies_by_position(dim: int, max_positions: int, params: dict) -> torch.Tensor:
    # [max_positions, pairs] for the length-dependent types (see the module's NOTE), else [1, pairs].
    kind = rope_type(params)
    within = _trained_frequencies(dim, params)[None, :]
    if kind == "longrope":
        length = _original_length(params)
        past = _longrope_frequencies(dim, params, _required(params, "long_factor"))[None, :]
    elif kind == "dynamic":
        length = _max_length(params, max_positions)
        past = _dynamic_ntk_by_position(dim, max_positions, length, params)
    else:
        return within
    positions = torch.arange(max_positions)[:, None]
    return torch.where(positions < length, within, past)


def _trained_frequencies(dim: int, params: dict) -> torch.Tensor:
    kind = rope_type(params)
    if kind == "longrope":
        return _longrope_frequencies(dim, params, _required(params, "short_factor"))
    return _STATIC[kind](dim, params)


def _base(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _theta(params: dict) -> float:
    return float(params.get("rope_theta") or _DEFAULT_THETA)


def _default(dim: int, params: dict) -> torch.Tensor:
    return _base(dim, _theta(params))


def _linear(dim: int, params: dict) -> torch.Tensor:
    return _base(dim, _theta(params)) / float(_required(params, "factor"))


def _dynamic_within(dim: int, params: dict) -> torch.Tensor:
    # transformers' NTK base for a sequence of max_position_embeddings tokens, in its
    # float64 arithmetic: the plain base, up to rounding.
    factor = float(_required(params, "factor"))
    trained = params.get("max_position_embeddings") or 1
    return _base(dim, _theta(params) * ((factor * trained / trained) - (factor - 1)) ** (dim / (dim - 2)))


def _dynamic_ntk_by_position(dim: int, max_positions: int, trained: int, params: dict) -> torch.Tensor:
    # Row p: the base transformers computes for a sequence of max(p + 1, trained) tokens,
    # with its float32 arithmetic. [max_positions, pairs]
    factor = float(_required(params, "factor"))
    lengths = torch.arange(1, max_positions + 1).clamp(min=trained)
    stretch = (factor * lengths / trained) - (factor - 1)
    # NOTE: transformers raises a 0-dim tensor to the power, which rounds as float64 does;
    # a float32 vector's pow can be an ulp off, enough to move cos by 1e-5 at long positions.
    bases = _theta(params) * (stretch.double() ** (dim / (dim - 2))).float()
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (bases[:, None] ** exponents[None, :])


def _llama3(dim: int, params: dict) -> torch.Tensor:
    # Long wavelengths are slowed down by `factor`, short ones kept, and the band
    # between is interpolated smoothly (LLaMA 3.1's context extension).
    inv_freq = _base(dim, _theta(params))
    factor = float(_required(params, "factor"))
    low, high = float(_required(params, "low_freq_factor")), float(_required(params, "high_freq_factor"))
    old_len = float(_original_length(params))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn(dim: int, params: dict) -> torch.Tensor:
    # High frequencies (many turns within the pretrained length) are kept, low ones
    # interpolated by `factor`, with a linear ramp between beta_fast and beta_slow turns.
    theta, factor = _theta(params), _yarn_factor(params)
    wavelengths = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)  # per radian
    low, high = _yarn_band(dim, theta, params)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return (1.0 / (factor * wavelengths)) * (1 - keep) + (1.0 / wavelengths) * keep


def _yarn_band(dim: int, theta: float, params: dict) -> tuple[float, float]:
    # The pair indices that turn beta_fast and beta_slow times within the pretrained length.
    length = _original_length(params)
    turns_fast, turns_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def pair_index(turns: float) -> float:
        return (dim * math.log(length / (turns * 2 * math.pi))) / (2 * math.log(theta))

    low, high = pair_index(turns_fast), pair_index(turns_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn_factor(params: dict) -> float:
    # DeepSeek-style configs leave `factor` out and mean the ratio of the two lengths.
    factor = params.get("factor")
    if factor is None:
        return float(_required(params, "max_position_embeddings")) / _original_length(params)
    return float(factor)


def _longrope_frequencies(dim: int, params: dict, factors: list[float]) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * _theta(params) ** exponents)


def _attention_factor(params: dict) -> float:
    # The factor transformers multiplies cos and sin by: YaRN's mscale, LongRoPE's sqrt term.
    kind = rope_type(params)
    given = params.get("attention_factor")
    if kind not in ("yarn", "longrope"):
        return 1.0
    if given is not None:
        return float(given)
    if kind == "yarn":
        return _yarn_mscale(params)
    factor = params.get("factor")
    if factor is None:
        factor = float(_required(params, "max_position_embeddings")) / _original_length(params)
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(_original_length(params)))


def _yarn_mscale(params: dict) -> float:
    factor, mscale, mscale_all_dim = _yarn_factor(params), params.get("mscale"), params.get("mscale_all_dim")

    def scale(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    if mscale and mscale_all_dim:
        return float(scale(mscale) / scale(mscale_all_dim))
    return scale(1)


def _original_length(params: dict) -> int:
    return int(params.get("original_max_position_embeddings") or _required(params, "max_position_embeddings"))


def _max_length(params: dict, max_positions: int) -> int:
    # Dynamic NTK counts from max_position_embeddings; without it, from the table's length.
    return int(params.get("max_position_embeddings") or max_positions)


def _required(params: dict, key: str):
    value = params.get(key)
    if value is None:
        raise ConfigError(
            f"rope_parameters.{key}",
            value,
            f"required for rope_type {rope_type(params)!r}",
            problem="is missing",
            subject=f"rope_parameters[{key!r}]",
        )
    return value


_STATIC: dict[str, Callable[[int, dict], torch.Tensor]] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic_within,
    "llama3": _llama3,
    "yarn": _yarn,
}


def rope_parameters_for(cfg: dict, layer_type: str | None = None) -> dict:
    """RoPE settings of one layer type, from a Hugging Face ``config.json`` of any vintage.

    Reads ``rope_parameters`` (flat, or per layer type as Gemma 3 has it), else the legacy
    ``rope_theta`` + ``rope_scaling`` (and Gemma 3's ``rope_local_base_freq``), and adds
    the top-level ``max_position_embeddings``, ``original_max_position_embeddings`` and
    ``partial_rotary_factor`` the variants need. ``rope_type`` comes back canonical.
    ``layer_type`` (``"sliding_attention"``, ``"full_attention"``) is required where the
    settings differ by layer type and ignored where they do not.
    """
    per_layer = _per_layer_types(cfg)
    if per_layer:
        if layer_type not in per_layer:
            raise ConfigError("layer_type", layer_type, f"choose one of {sorted(per_layer)}")
        params = _layer_parameters(cfg, layer_type)
    else:
        params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
        params.setdefault("rope_theta", cfg.get("rope_theta", _DEFAULT_THETA))
    params["rope_type"] = rope_type(params)
    params.pop("type", None)
    _add_top_level(cfg, params, flat=not per_layer)
    return params


# Gemma 3 rotates its sliding-window layers with a base of their own; its config class
# fills in both bases when config.json leaves them out.
_PER_LAYER_THETA_MODELS = {"gemma3", "gemma3_text"}
_PER_LAYER_DEFAULT_THETA = {"sliding_attention": 10000.0, "full_attention": 1000000.0}


def _per_layer_types(cfg: dict) -> set[str]:
    stored = cfg.get("rope_parameters") or {}
    labels = set(cfg.get("layer_types") or ()) | set(_PER_LAYER_DEFAULT_THETA)
    nested = {key for key, value in stored.items() if key in labels and isinstance(value, dict)}
    if cfg.get("model_type") in _PER_LAYER_THETA_MODELS or "rope_local_base_freq" in cfg:
        nested |= set(_PER_LAYER_DEFAULT_THETA)
    return nested


def _layer_parameters(cfg: dict, layer_type: str) -> dict:
    stored = cfg.get("rope_parameters") or {}
    if isinstance(stored.get(layer_type), dict):
        params = dict(stored[layer_type])
    elif layer_type == "full_attention":
        params = dict(cfg.get("rope_scaling") or {})  # legacy scaling applies to the global layers only
    else:
        params = {}
    if layer_type == "sliding_attention":
        theta = cfg.get("rope_local_base_freq", _PER_LAYER_DEFAULT_THETA[layer_type])
    else:
        theta = cfg.get("rope_theta", _PER_LAYER_DEFAULT_THETA.get(layer_type, _DEFAULT_THETA))
    params.setdefault("rope_theta", theta)
    return params


def _add_top_level(cfg: dict, params: dict, flat: bool) -> None:
    if cfg.get("max_position_embeddings") is not None:
        params["max_position_embeddings"] = cfg["max_position_embeddings"]
    partial = cfg.get("partial_rotary_factor")
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    original = cfg.get("original_max_position_embeddings")
    if original is not None and flat and params["rope_type"] in _TRAINED_LENGTH_TYPES:
        params["original_max_position_embeddings"] = original  # as transformers: Phi-3 keeps it here
    elif original is not None:
        params.setdefault("original_max_position_embeddings", original)
    if params["rope_type"] in _TRAINED_LENGTH_TYPES and params.get("max_position_embeddings") is not None:
        params.setdefault("original_max_position_embeddings", params["max_position_embeddings"])


class RotaryEmbedding(nn.Module):
    """Rotates query and key heads by their token positions, from a precomputed table.

    Only the first ``rotary_dim`` dims of each head turn (``partial_rotary_factor``); the
    rest pass through.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, params: dict) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_width(head_dim, params)
        cos, sin = rotation_table(head_dim, max_positions, params)
        self.register_buffer("cos", cos, persistent=False)  # [max_positions, rotary_dim]
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions: [num_tokens]; q: [num_tokens, heads * head_dim]; k: [num_tokens, kv_heads * head_dim]
        # NOTE: q and k are rotated in place where the compiled kernel runs: they are this layer's own projections.
        cos, sin = self.cos, self.sin  # [max_positions, rotary_dim]
        if runs_on_triton(q):
            return rotary_embedding(positions, q, k, cos, sin, self.head_dim)
        both, d = _side_by_side(q, k), self.head_dim
        if both is None:
            return rotary_cpu_(q, cos, sin, positions, d), rotary_cpu_(k, cos, sin, positions, d)
        # NOTE: q and k are neighbouring columns of one fused projection's output: one call turns both
        turned = rotary_cpu_(both, cos, sin, positions, d)
        if turned is both:  # in place: q and k are turned already
            return q, k
        return turned[:, : q.shape[1]], turned[:, q.shape[1] :]


def _side_by_side(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """``q`` and ``k`` as one [tokens, q + k columns] view when ``k``'s columns follow ``q``'s in
    the same rows of one tensor (the fused q/k/v projection's output); else None."""
    if q.dim() != 2 or k.dim() != 2 or q.dtype != k.dtype or q.stride() != k.stride() or q.stride(-1) != 1:
        return None
    if q.shape[0] != k.shape[0] or k.data_ptr() != q.data_ptr() + q.shape[1] * q.element_size():
        return None
    try:
        # NOTE: torch refuses a view past the end of q's storage, so one it makes holds k's
        # columns in q's own memory (cheaper than comparing the two tensors' storages)
        return q.as_strided((q.shape[0], q.shape[1] + k.shape[1]), q.stride())
    except RuntimeError:
        return None
