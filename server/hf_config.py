"""A Hugging Face model directory's ``config.json``, read as ``transformers`` reads it.

NOTE: torch-free: the API server checks the model directory before it starts the engine.
"""

from __future__ import annotations

import json
import os


def read_hf_config(model_dir: str) -> dict:
    """``config.json`` as transformers reads it: its defaults filled in, ``layer_types`` and
    ``rope_parameters`` in their current form, whatever the file's vintage."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"model={model_dir!r} is not a model directory: {path} does not exist "
            "(models are not downloaded; pass a local Hugging Face directory)"
        )
    with open(path) as f:
        return normalized_config(json.load(f))


# NOTE: taken from the file only; a config class's defaults for these are another model's tokens.
_FILE_ONLY_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def normalized_config(raw: dict) -> dict:
    """``raw`` with what transformers' config class for its ``model_type`` derives and defaults."""
    from transformers import AutoConfig

    model_type = raw.get("model_type")
    try:
        fields = {k: v for k, v in raw.items() if k != "model_type"}
        full = AutoConfig.for_model(model_type, **fields).to_dict() if model_type else {}
    except (ValueError, KeyError, TypeError):  # a model type transformers does not know
        return raw
    for key in _FILE_ONLY_KEYS:
        full.pop(key, None)
        if key in raw:
            full[key] = raw[key]
    return full
