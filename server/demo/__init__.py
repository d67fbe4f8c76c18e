"""The embedded default model, and the tiny random LLaMA with a byte-level tokenizer that tests use.

``pagedllm serve`` without ``--model`` serves ``model/`` next to this file: a small
LLaMA trained on the Python standard library's own documentation by
:mod:`pagedllm.server.demo.train`, with its own BPE tokenizer and chat template.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any

BYTE_SPECIALS = ("<s>", "</s>", "<pad>")
DEMO_NAME = "demo-llama-bytes-v1"
SHIPPED_DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model")
logger = logging.getLogger("pagedllm.demo")


def build_byte_tokenizer():
    """A Hugging Face fast tokenizer whose tokens are the 256 bytes plus <s>, </s>, <pad>.

    Every text round-trips exactly; ids 0-255 are bytes (in GPT-2's printable mapping).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=_byte_of)
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    for i, special in enumerate(BYTE_SPECIALS):
        vocab[special] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def _byte_of(char: str) -> int:
    # GPT-2's byte-to-unicode map: printable bytes map to themselves, the rest to 256+.
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    if ord(char) in printable:
        return ord(char)
    others = [b for b in range(256) if b not in printable]
    return others[ord(char) - 256]


def demo_llama_config(**overrides):
    from transformers import LlamaConfig

    values: dict[str, Any] = dict(
        vocab_size=256 + len(BYTE_SPECIALS),
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        tie_word_embeddings=False,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def save_tiny_llama(path: str, seed: int = 0, **overrides) -> str:
    """Write a random-weight LLaMA with the byte tokenizer to ``path`` (safetensors)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(demo_llama_config(**overrides))
    model.save_pretrained(path, safe_serialization=True)
    build_byte_tokenizer().save_pretrained(path)
    return path


def cache_dir() -> str:
    return os.environ.get("PAGEDLLM_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pagedllm"))


def ensure_demo_model() -> str:
    """The demo model's directory: the trained one shipped in the package.

    An install without the package data (``model/``) falls back to a random-weight
    byte-level LLaMA built once in the cache, with a warning: it runs, but says nothing readable.
    """
    if os.path.isfile(os.path.join(SHIPPED_DEMO_DIR, "config.json")):
        return SHIPPED_DEMO_DIR
    logger.warning(
        "the trained demo model is missing from %s: serving a random-weight model instead "
        "(train it with `python -m pagedllm.server.demo.train`)",
        SHIPPED_DEMO_DIR,
    )
    return ensure_random_demo_model()


def ensure_random_demo_model() -> str:
    """A random-weight tiny LLaMA with the byte tokenizer, built in the cache the first time."""
    path = os.path.join(cache_dir(), DEMO_NAME)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_dir(), prefix=".build-")
    try:
        save_tiny_llama(tmp)
        os.replace(tmp, path)
    except OSError:
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
