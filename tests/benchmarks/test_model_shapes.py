"""The benchmark's model shapes are the published models' sizes, and a written model loads in our engine."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.model_shapes import SHAPES, model_vocab, shape_config, write_random_model


@pytest.mark.parametrize(
    ("shape", "millions"), [("qwen2.5-0.5b", 494.0), ("qwen2.5-1.5b", 1543.7), ("llama-3.2-1b", 1235.8)]
)
def test_real_shapes_have_the_published_parameter_counts(shape, millions):
    cls, config = shape_config(shape)
    with torch.device("meta"):
        model = cls(config)
    # NOTE: a tied head shares the embedding's parameter, counted once (as the model cards count)
    assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(millions, abs=0.1)
    assert config.tie_word_embeddings


def test_a_written_model_is_read_back_by_our_engine_with_its_vocabulary(tmp_path, monkeypatch):
    from pagedllm.server import LLM, SamplingParams
    from pagedllm.server.worker.models.cpu_linear import is_packed

    tiny = dict(SHAPES["qwen2.5-0.5b"], hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    tiny |= dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    monkeypatch.setitem(SHAPES, "tiny-qwen", tiny)
    params = write_random_model(str(tmp_path), "tiny-qwen", "bfloat16")
    assert params > 0 and model_vocab(str(tmp_path)) == 512
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, block_size=16, num_gpu_blocks_override=16)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert is_packed(llm.llm_engine.runner.model.lm_head.weight)  # the tied head packed its own copy
    llm.shutdown()


def test_the_tokenizer_of_a_large_vocabulary_has_exactly_its_ids_and_round_trips_them(tmp_path):
    from transformers import AutoTokenizer

    from benchmarks.model_shapes import write_tokenizer

    vocab = SHAPES["qwen2.5-0.5b"]["vocab_size"]
    write_tokenizer(str(tmp_path), vocab, 4096)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": vocab}))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))  # NOTE: by the family's class, as vLLM's client loads it
    ids = tok.get_vocab().values()
    assert len(tok) == vocab and max(ids) == vocab - 1
    sample = [5, 1000, vocab // 2, vocab - 1]  # trained tokens and placeholders alike
    assert tok.encode(tok.decode(sample), add_special_tokens=False) == sample
