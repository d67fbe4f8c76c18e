"""Request and response bodies of the OpenAI-compatible API (pydantic), as OpenAI and vLLM name them.

Types live here; value ranges are checked once, by :class:`SamplingParams`, and reach
the client as a 400 naming the field and the value.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

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
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# -- shared -------------------------------------------------------------------------------
class StreamOptions(OpenAIBaseModel):
    include_usage: Optional[bool] = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class SamplingFields(OpenAIBaseModel):
    """Fields both completion endpoints share (OpenAI's, then vLLM's extras)."""

    model: Optional[str] = Field(None, description="The served model name; defaults to it.")
    max_tokens: Optional[int] = Field(16, description="Most tokens to generate; null = up to max_model_len.")
    temperature: Optional[float] = Field(None, description="Default: the model's generation_config, else 1.0.")
    top_p: Optional[float] = Field(None, description="Default: the model's generation_config, else 1.0.")
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    seed: Optional[int] = Field(None, ge=SEED_MIN, le=SEED_MAX)
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = Field(None, description="Not supported; must be empty.")
    # vLLM's extras
    best_of: Optional[int] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


# -- /v1/completions ------------------------------------------------------------------------
PromptInput = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput = Field(..., description="A string, strings, token ids, or lists of token ids.")
    echo: Optional[bool] = False
    logprobs: Optional[int] = Field(None, description="Log-probabilities of this many most likely tokens.")
    suffix: Optional[str] = Field(None, description="Not supported; must be null.")


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


# -- /v1/chat/completions ------------------------------------------------------------------
class ContentPart(OpenAIBaseModel):
    type: str
    text: Optional[str] = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = Field(None, description="Most tokens to generate; null = up to max_model_len.")
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    response_format: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    add_generation_prompt: bool = True


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIBaseModel):
    content: Optional[list[TokenLogprob]] = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: Optional[str] = None


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


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
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = None
    prompt: Optional[str] = Field(None, description="Text to tokenize (or give messages).")
    messages: Optional[list[ChatMessage]] = Field(None, description="Chat messages, rendered with the template.")
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class VersionResponse(OpenAIBaseModel):
    version: str
