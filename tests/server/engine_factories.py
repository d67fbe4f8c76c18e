"""Factories for engine tests: tiny random LLaMA checkpoints and the transformers reference."""

from __future__ import annotations

import json
import os

import torch

from pagedllm.server.demo import BYTE_SPECIALS, build_byte_tokenizer

TINY_SHAPES = {
    # name -> LlamaConfig overrides
    "mha": dict(
        num_attention_heads=4, num_key_value_heads=4, hidden_size=64, intermediate_size=128, initializer_range=0.2
    ),
    "gqa": dict(
        num_attention_heads=8,
        num_key_value_heads=2,
        hidden_size=64,
        intermediate_size=128,
        rope_theta=500000.0,
        initializer_range=0.2,
    ),
}


def make_prompts(num: int, vocab: int = 256, min_len: int = 1, max_len: int = 220, seed: int = 0) -> list[list[int]]:
    """Random token prompts whose lengths span min_len to max_len."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(min_len, max_len, num).round().int().tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


class HFReference:
    """Greedy continuations and logits from Hugging Face transformers on the same weights."""

    def __init__(self, model_dir: str, dtype: torch.dtype = torch.float32, **kwargs) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs).eval()

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return out[0, len(prompt) :].tolist()

    @torch.no_grad()
    def logprobs(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), vocab] log-probabilities of the next token after each prefix."""
        logits = self.model(torch.tensor([tokens])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    @torch.no_grad()
    def embedding(self, tokens: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
        """The final hidden state (after the final norm) of the last token or the mean over all, L2-normalised."""
        hidden = self.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
        pooled = hidden[-1] if pooling == "last" else hidden.mean(0)
        return torch.nn.functional.normalize(pooled, dim=0) if normalize else pooled


def assert_greedy_matches(
    ref: HFReference, prompt: list[int], ours: list[int], expected: list[int], tol: float = 1e-3
) -> None:
    """Tokens must be equal; at a first difference the reference must be a near-tie."""
    if ours == expected:
        return
    i = next(k for k, (a, b) in enumerate(zip(ours, expected)) if a != b)
    lp = ref.logprobs(prompt + expected[:i])[-1]
    gap = float(lp[expected[i]] - lp[ours[i]])
    assert gap < tol, (
        f"token {i} differs: ours {ours[i]} vs reference {expected[i]}, logprob gap {gap:.2e} is not a near-tie"
    )


_COMMON = dict(vocab_size=256 + len(BYTE_SPECIALS), bos_token_id=256, eos_token_id=257, pad_token_id=258)
_OPT = dict(
    _COMMON,
    hidden_size=64,
    ffn_dim=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    init_std=0.2,
    dropout=0.0,
)
_GPT2 = dict(
    _COMMON,
    n_embd=64,
    n_layer=2,
    n_head=4,
    n_positions=256,
    initializer_range=0.2,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)


def hf_config(family: str, **overrides):
    from transformers import GPT2Config, OPTConfig

    if family == "opt":
        return OPTConfig(**{**_OPT, **overrides})
    return GPT2Config(**{**_GPT2, **overrides})


_MISTRAL = dict(
    _COMMON,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    tie_word_embeddings=False,
)


def save_tiny_mistral(path: str, seed: int, sliding_window: int | None, **overrides) -> str:
    """Write a random-weight Mistral (GQA, every layer windowed) with the byte tokenizer to ``path``."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    config = MistralConfig(**{**_MISTRAL, "sliding_window": sliding_window, **overrides})
    MistralForCausalLM(config).save_pretrained(path, safe_serialization=True)
    build_byte_tokenizer().save_pretrained(path)
    return path


def save_tiny(path: str, family: str, seed: int, **overrides) -> str:
    """Write a random-weight OPT or GPT-2 with the byte tokenizer to ``path`` (safetensors)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(hf_config(family, **overrides)).save_pretrained(path, safe_serialization=True)
    build_byte_tokenizer().save_pretrained(path)
    return path


def write_sentence_transformers_pooling(model_dir: str, **modes: bool) -> None:
    """Make ``model_dir`` a sentence-transformers checkpoint whose Pooling module sets ``modes``."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    with open(os.path.join(model_dir, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(model_dir, "1_Pooling"), exist_ok=True)
    config = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False}
    with open(os.path.join(model_dir, "1_Pooling", "config.json"), "w") as f:
        json.dump({**config, **modes}, f)
