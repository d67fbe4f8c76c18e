"""The offline API, call-compatible with vLLM's ``LLM``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TypeVar

from tqdm.auto import tqdm

from pagedllm.server.config import EngineConfig
from pagedllm.server.engine.input_processor import PromptType
from pagedllm.server.engine.llm_engine import LLMEngine
from pagedllm.server.lora_request import LoRARequest
from pagedllm.server.outputs import EmbeddingRequestOutput, EngineOutput, RequestOutput
from pagedllm.server.pooling_params import PoolingParams
from pagedllm.server.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Generate completions for a batch of prompts: ``LLM(model=path).generate(prompts, params)``.

    ``with LLM(model=path) as llm:`` (or :meth:`shutdown`) releases the engine at a known
    point: its tensor-parallel ranks, process group and KV cache. Dropping the last
    reference does the same, so another ``LLM`` can be built in the same process either way.
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args))
        self._counter = 0

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm.llm_engine = LLMEngine(config)
        llm._counter = 0
        return llm

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing done) while requests hold blocks."""
        return self.llm_engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, leave the process group and free the KV cache (idempotent).

        A later :meth:`generate` raises :class:`~pagedllm.server.engine.llm_engine.EngineClosedError`.
        """
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: None | SamplingParams | Sequence[SamplingParams] = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        ``lora_request`` runs every prompt with one adapter, or each with its own (a list,
        None for the base model); the engine needs ``enable_lora=True``.
        """
        prompts = _prompt_list(prompts)
        given = sampling_params or SamplingParams()
        params = [given] * len(prompts) if isinstance(given, SamplingParams) else list(given)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts: pass one or one each")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts: pass one or one each")
        return [_expect(o, RequestOutput) for o in self._run_all(prompts, params, use_tqdm, loras)]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in prompt order: ``llm.embed(texts)[i].outputs.embedding``.

        The prompts are prefilled in the same batches as any generation (chunked when long)
        and pooled (``pooling_type``: the last token's final hidden state by default, or the
        mean); embeddings are L2-normalised unless ``PoolingParams(normalize=False)``.
        """
        prompts = _prompt_list(prompts)
        params = [pooling_params or PoolingParams()] * len(prompts)
        return [_expect(o, EmbeddingRequestOutput) for o in self._run_all(prompts, params, use_tqdm)]

    def _run_all(
        self,
        prompts: list[PromptType],
        params: Sequence[SamplingParams | PoolingParams],
        use_tqdm: bool,
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[EngineOutput]:
        engine = self.llm_engine
        ids = []
        finals: dict[int, SamplingParams] = {}
        try:
            for prompt, p, lora in zip(prompts, params, loras or [None] * len(prompts)):
                if isinstance(p, SamplingParams) and p.output_kind is RequestOutputKind.CUMULATIVE:
                    # NOTE: only the last output is kept: the engine builds none for the steps before it
                    final = finals.get(id(p)) or replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                    p = finals.setdefault(id(p), final)
                request_id = str(self._counter)
                self._counter += 1
                engine.add_request(request_id, prompt, p, lora_request=lora)
                ids.append(request_id)
            return self._run(ids, use_tqdm)
        finally:
            engine.abort_request(ids)  # NOTE: frees whatever an error left behind; finished ids are ignored

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        beam_width: int,
        max_tokens: int,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        ignore_eos: bool = False,
        n: int | None = None,
    ) -> list[RequestOutput]:
        """Beam search with ``beam_width`` beams; each output holds the ``n`` (default all) best beams."""
        params = SamplingParams(
            use_beam_search=True,
            best_of=beam_width,
            n=n or beam_width,
            temperature=0.0,
            max_tokens=max_tokens,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            ignore_eos=ignore_eos,
        )
        return self.generate(prompts, params)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[EngineOutput]:
        done: dict[str, EngineOutput] = {}
        with tqdm(total=len(ids), desc="requests", disable=not use_tqdm) as bar:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished:
                        done[output.request_id] = output
                        bar.update(1)
        return [done[i] for i in ids]


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (a string, token ids or a dict) or several, as a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


_O = TypeVar("_O", RequestOutput, EmbeddingRequestOutput)


def _expect(output: EngineOutput, kind: type[_O]) -> _O:
    assert isinstance(output, kind), f"a {kind.__name__} was expected, got {type(output).__name__}"
    return output
