"""Embeddings through the engine: pooled final hidden states equal transformers' (last token and mean,
normalised or not), for prompts prefilled in chunks, batched with generation, preempted, across two
tensor-parallel ranks; every block is free afterwards."""

from __future__ import annotations

import pytest
import torch
from engine_factories import HFReference, assert_greedy_matches, make_prompts, write_sentence_transformers_pooling

from pagedllm.server import LLM, PoolingParams, SamplingParams
from pagedllm.server.config import ConfigError, EngineConfig
from pagedllm.server.engine.llm_engine import LLMEngine
from pagedllm.server.engine.model_info import pooling_type
from pagedllm.server.outputs import EmbeddingRequestOutput, RequestOutput
from tests.support import assert_all_blocks_free

pytestmark = pytest.mark.timeout(300)
ATOL = 1e-5


@pytest.fixture(scope="module")
def hf(tiny_llama) -> HFReference:
    return HFReference(tiny_llama)


def engine(model_dir: str, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(model=model_dir, device="cpu", **{"block_size": 16, **kwargs}))


def run(e: LLMEngine) -> dict[str, RequestOutput | EmbeddingRequestOutput]:
    done = {}
    while e.has_unfinished_requests():
        done.update({o.request_id: o for o in e.step() if o.finished})
    return done


def assert_embedding(output, expected: torch.Tensor) -> None:
    assert isinstance(output, EmbeddingRequestOutput) and output.error is None and output.finished
    got = torch.tensor(output.outputs.embedding)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


# prompts of 1 token, under one block, several blocks (block_size 16), and past the step's token budget
LENGTHS = (1, 7, 16, 40, 130)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_batched_chunked_embeddings_equal_transformers_hidden_states(tiny_llama, hf, pooling):
    prompts = [make_prompts(1, min_len=n, max_len=n, seed=n)[0] for n in LENGTHS]
    e = engine(tiny_llama, max_num_batched_tokens=32)  # NOTE: the 40- and 130-token prompts are chunked
    for i, prompt in enumerate(prompts):
        e.add_request(f"e{i}", {"prompt_token_ids": prompt}, PoolingParams(pooling_type=pooling))
    done, longest = {}, []
    while e.has_unfinished_requests():
        for output in e.step():
            if output.request_id == "e4":
                longest.append(output)
            if output.finished:
                done[output.request_id] = output
    assert len(longest) >= -(-130 // 32)  # the longest prompt ran in several steps
    assert all(not o.finished and o.outputs.embedding == [] for o in longest[:-1])  # reported while prefilling
    for i, prompt in enumerate(prompts):
        assert_embedding(done[f"e{i}"], hf.embedding(prompt, pooling))
        assert done[f"e{i}"].prompt_token_ids == prompt
    assert_all_blocks_free(e)


def test_normalize_false_gives_the_raw_hidden_state(tiny_llama, hf):
    prompt = make_prompts(1, min_len=21, max_len=21, seed=9)[0]
    llm = LLM(model=tiny_llama, device="cpu")
    for pooling in ("last", "mean"):
        [out] = llm.embed({"prompt_token_ids": prompt}, PoolingParams(pooling_type=pooling, normalize=False))
        assert_embedding(out, hf.embedding(prompt, pooling, normalize=False))
        assert abs(torch.tensor(out.outputs.embedding).norm().item() - 1.0) > 1e-2  # really not normalised


def test_llm_embed_takes_text_and_defaults_to_last_token_pooling(tiny_llama, hf):
    llm = LLM(model=tiny_llama, device="cpu")
    texts = ["The paged KV cache", "blocks"]
    outs = llm.embed(texts)
    assert [o.prompt for o in outs] == texts
    for text, out in zip(texts, outs):
        ids = llm.get_tokenizer().encode(text)
        assert out.prompt_token_ids == ids
        assert_embedding(out, hf.embedding(ids, "last"))
    assert llm.llm_engine.model_info.pooling_type == "last"


def test_embeddings_share_steps_with_generation_and_both_match_transformers(tiny_llama, hf):
    gen_prompt, *embed_prompts = make_prompts(3, min_len=10, max_len=70, seed=4)
    e = engine(tiny_llama, max_num_batched_tokens=48)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    e.add_request("gen", {"prompt_token_ids": gen_prompt}, greedy)
    e.step()  # the generation request decodes from now on
    e.add_request("last", {"prompt_token_ids": embed_prompts[0]}, PoolingParams())
    e.add_request("mean", {"prompt_token_ids": embed_prompts[1]}, PoolingParams(pooling_type="mean"))
    outputs = {o.request_id: o for o in e.step()}
    assert set(outputs) == {"gen", "last", "mean"}  # one iteration: a decode and two prompt chunks
    assert len(outputs["gen"].outputs[0].token_ids) == 2
    done = {**{k: o for k, o in outputs.items() if o.finished}, **run(e)}
    assert_embedding(done["last"], hf.embedding(embed_prompts[0], "last"))
    assert_embedding(done["mean"], hf.embedding(embed_prompts[1], "mean"))
    tokens = done["gen"].outputs[0].token_ids
    assert_greedy_matches(hf, gen_prompt, tokens, hf.greedy(gen_prompt, 12))
    assert_all_blocks_free(e)


def test_an_embedding_frees_its_blocks_in_the_step_that_pools_it(tiny_llama):
    e = engine(tiny_llama)
    e.add_request("e", {"prompt_token_ids": list(range(50))}, PoolingParams())
    [out] = e.step()
    assert out.finished and len(out.outputs.embedding) == 64
    assert_all_blocks_free(e)


def test_a_prompt_may_fill_max_model_len_but_not_exceed_it(tiny_llama, hf):
    e = engine(tiny_llama, max_model_len=64)
    full = make_prompts(1, min_len=64, max_len=64, seed=2)[0]
    e.add_request("full", {"prompt_token_ids": full}, PoolingParams())
    assert_embedding(run(e)["full"], hf.embedding(full, "last"))
    with pytest.raises(ConfigError) as info:
        e.add_request("long", {"prompt_token_ids": full + [1]}, PoolingParams())
    assert (info.value.field, info.value.value) == ("prompt", 65)
    assert "longer than max_model_len=64" in str(info.value) and "at most 64 tokens" in str(info.value)
    with pytest.raises(ConfigError, match="no room to generate"):
        e.add_request("gen", {"prompt_token_ids": full}, SamplingParams())  # generation still needs a free slot
    assert_all_blocks_free(e)


def test_dimensions_and_unknown_pooling_are_refused(tiny_llama):
    e = engine(tiny_llama)
    with pytest.raises(ConfigError) as info:
        e.add_request("d", [1, 2, 3], PoolingParams(dimensions=32))
    assert (info.value.field, info.value.value) == ("dimensions", 32)
    assert "matryoshka" in str(info.value)
    with pytest.raises(ConfigError) as info:
        PoolingParams(dimensions=0)
    assert info.value.field == "dimensions"
    with pytest.raises(ConfigError) as info:
        PoolingParams(pooling_type="cls")
    assert (info.value.field, info.value.value) == ("pooling_type", "cls")
    assert_all_blocks_free(e)


def test_preempted_mean_pooling_restarts_its_sum_and_still_matches(tiny_llama, hf):
    """A later-arrived embedding is preempted (recomputed) mid-prefill when a generation grows into the tiny cache."""
    e = engine(tiny_llama, block_size=4, num_gpu_blocks_override=14, max_num_batched_tokens=4, max_model_len=56)
    gen_prompt = make_prompts(1, min_len=24, max_len=24, seed=1)[0]  # grows to 54 tokens: all 14 blocks
    embed_prompt = make_prompts(1, min_len=28, max_len=28, seed=3)[0]  # 7 blocks, 3 tokens a step
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    e.add_request("gen", {"prompt_token_ids": gen_prompt}, greedy)
    while e.scheduler.waiting:
        e.step()
    e.add_request("mean", {"prompt_token_ids": embed_prompt}, PoolingParams(pooling_type="mean"))
    mean_seq = e.scheduler.waiting[-1].seqs[0]
    computed_before_preemption = 0
    for _ in range(30):
        computed_before_preemption = mean_seq.num_computed_tokens
        e.step()
        if e.scheduler.num_preemptions:
            break
    assert e.scheduler.num_preemptions == 1
    assert 0 < computed_before_preemption < len(embed_prompt)  # part of its sum was thrown away
    done = run(e)
    assert_embedding(done["mean"], hf.embedding(embed_prompt, "mean"))
    assert len(done["gen"].outputs[0].token_ids) == 30
    assert_all_blocks_free(e)


def test_last_token_pooling_reuses_cached_prefix_blocks_and_mean_computes_every_position(tiny_llama, hf):
    e = engine(tiny_llama, enable_prefix_caching=True)
    prompt = make_prompts(1, min_len=50, max_len=50, seed=6)[0]
    for pooling, hits in (("last", 48), ("mean", 0)):
        for request_id in (f"{pooling}-1", f"{pooling}-2"):
            before = e.block_manager.prefix_cache_hits
            e.add_request(request_id, {"prompt_token_ids": prompt}, PoolingParams(pooling_type=pooling))
            assert_embedding(run(e)[request_id], hf.embedding(prompt, pooling))
        assert e.block_manager.prefix_cache_hits - before == hits  # the second request's full cached blocks
    assert_all_blocks_free(e)


def test_an_aborted_embedding_frees_its_blocks(tiny_llama):
    e = engine(tiny_llama, max_num_batched_tokens=16)
    e.add_request("e", {"prompt_token_ids": list(range(100))}, PoolingParams(pooling_type="mean"))
    e.step()
    assert e.block_manager.gpu.num_free < e.block_manager.gpu.num_blocks
    e.abort_request("e")
    assert_all_blocks_free(e)


# -- the pooling a model asks for ---------------------------------------------------------------
def test_pooling_type_comes_from_the_flag_then_sentence_transformers_then_last(tmp_path):
    model_dir = str(tmp_path)

    def resolved(**kwargs) -> str:
        return pooling_type(EngineConfig.from_kwargs(model=model_dir, **kwargs), model_dir)

    assert resolved() == "last"  # no modules.json
    write_sentence_transformers_pooling(model_dir, pooling_mode_mean_tokens=True)
    assert resolved() == "mean"
    assert resolved(pooling_type="last") == "last"
    write_sentence_transformers_pooling(model_dir, pooling_mode_lasttoken=True)
    assert resolved() == "last"
    write_sentence_transformers_pooling(model_dir, pooling_mode_cls_token=True)
    with pytest.raises(ConfigError) as info:
        resolved()
    assert info.value.field == "pooling_type" and "pooling_mode_cls_token" in str(info.value)
    assert resolved(pooling_type="mean") == "mean"  # the flag settles it without reading the file
    with pytest.raises(ConfigError):
        EngineConfig.from_kwargs(model=model_dir, pooling_type="max")


def test_a_sentence_transformers_model_is_mean_pooled_by_default(tmp_path, hf, tiny_llama):
    import shutil

    model_dir = str(tmp_path / "st")
    shutil.copytree(tiny_llama, model_dir)
    write_sentence_transformers_pooling(model_dir, pooling_mode_mean_tokens=True)
    llm = LLM(model=model_dir, device="cpu")
    prompt = make_prompts(1, min_len=33, max_len=33, seed=8)[0]
    [out] = llm.embed({"prompt_token_ids": prompt})
    assert_embedding(out, hf.embedding(prompt, "mean"))
    [out] = llm.embed({"prompt_token_ids": prompt}, PoolingParams(pooling_type="last"))  # a request may choose
    assert_embedding(out, hf.embedding(prompt, "last"))


def test_embeddings_at_two_tensor_parallel_ranks(tiny_llama, hf, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    prompts = [make_prompts(1, min_len=n, max_len=n, seed=n)[0] for n in (3, 45)]
    with LLM(model=tiny_llama, tensor_parallel_size=2, block_size=8, max_num_batched_tokens=16) as llm:
        for pooling in ("last", "mean"):
            outs = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(pooling_type=pooling))
            for prompt, out in zip(prompts, outs):
                assert_embedding(out, hf.embedding(prompt, pooling))
        assert_all_blocks_free(llm.llm_engine)
