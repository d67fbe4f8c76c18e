"""Request and response bodies of the OpenAI-compatible API (pydantic), as OpenAI and vLLM name them.

Types live here; value ranges are checked once, by :class:`SamplingParams`, and reach
the client as a 400 naming the field and the value.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# torch.Generator.manual_seed accepts exactly this range.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


class OpenAIBaseModel(BaseModel):
    # NOTE: unknown fields are ignored, as OpenAI does; NaN and infinity are rejected.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# -- errors -------------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# -- shared -------------------------------------------------------------------------------
class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = Field(0, description="Prompt tokens served from the prefix cache (whole KV blocks).")


class CompletionTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = Field(0, description="Completion tokens spent on reasoning (with --reasoning-parser).")


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class SamplingFields(OpenAIBaseModel):
    """Fields both completion endpoints share (OpenAI's, then vLLM's extras)."""

    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="Prefix-cache blocks are shared only between requests "
        "with the same salt: give each tenant its own.",
    )
    model: str | None = Field(None, description="The served model name; defaults to it.")
    max_tokens: int | None = Field(16, description="Most tokens to generate; null = up to max_model_len.")
    temperature: float | None = Field(None, description="Default: the model's generation_config, else 1.0.")
    top_p: float | None = Field(None, description="Default: the model's generation_config, else 1.0.")
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) -> bias in [-100, 100].")
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}'
    )
    # structured outputs, as vLLM names them (one at most, or response_format)
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = Field(
        None, description="One of json, regex, choice, grammar, json_object (vLLM's newer form)."
    )
    # vLLM's extras
    best_of: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


# -- /v1/completions ------------------------------------------------------------------------
PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput = Field(..., description="A string, strings, token ids, or lists of token ids.")
    echo: bool | None = False
    logprobs: int | None = Field(None, description="Log-probabilities of this many most likely tokens.")
    suffix: str | None = Field(None, description="Not supported; must be null.")


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# -- /v1/chat/completions ------------------------------------------------------------------
class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, description="Most tokens to generate; null = up to max_model_len.")
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = Field(
        True, description="false: at most one tool call per choice (the first the model makes)."
    )
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description='Extra variables for the chat template, e.g. {"enable_thinking": false} (Qwen3).',
    )
    reasoning_effort: ReasoningEffort | None = Field(
        None, description="How hard a reasoning model thinks: the template's reasoning_effort variable (gpt-oss)."
    )


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIBaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = Field(None, description="The model's reasoning (with --reasoning-parser).")
    reasoning: str | None = Field(None, description="The same as reasoning_content (vLLM's newer name).")
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


# -- models, tokenize, version ------------------------------------------------------------
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    """For a LoRA adapter: the base model it runs on (its ``root`` is the adapter's directory)."""
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str = Field(min_length=1, description="The name requests give as model.")
    lora_path: str = Field(min_length=1, description="The adapter's PEFT directory on the server.")


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_int_id: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = Field(None, description="Text to tokenize (or give messages).")
    messages: list[ChatMessage] | None = Field(None, description="Chat messages, rendered with the template.")
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class VersionResponse(OpenAIBaseModel):
    version: str


# -- /v1/embeddings ---------------------------------------------------------------------
class EmbeddingRequest(OpenAIBaseModel):
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="Prefix-cache blocks are shared only between requests with the same salt.",
    )
    model: str | None = Field(None, description="The served model name; defaults to it.")
    input: PromptInput = Field(..., description="A string, strings, token ids, or lists of token ids.")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: lists of numbers; base64: each embedding's little-endian float32 bytes."
    )
    dimensions: int | None = Field(None, description="Not supported by these models: must be null.")
    user: str | None = None
    # vLLM's extras
    normalize: bool = Field(True, description="Scale each embedding to unit L2 norm.")


class EmbeddingData(OpenAIBaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
