"""Request and response bodies of ``POST /v1/responses``, OpenAI's Responses API (pydantic).

The request is served as a chat completion (:mod:`.serving_responses` says how); these are
only its shapes, as the ``openai`` client sends and reads them.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StringConstraints, model_validator

from pagedllm.server.entrypoints.openai.protocol import OpenAIBaseModel, ReasoningEffort

ResponseStatus = Literal["completed", "incomplete", "in_progress"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]
MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]


# -- input items -------------------------------------------------------------------------------
class InputText(OpenAIBaseModel):
    """A text part of a message: ``input_text`` from the user, ``output_text`` from an earlier answer."""

    type: Literal["input_text", "output_text", "text"] = "input_text"
    text: str


class InputMessage(OpenAIBaseModel):
    """``{"role", "content"}``: the content a string or a list of text parts."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallInput(OpenAIBaseModel):
    """A function call the model made earlier, given back with the conversation."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="The arguments as JSON text.")
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputInput(OpenAIBaseModel):
    """What a function call returned, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: ItemStatus | None = None


class ReasoningInput(OpenAIBaseModel):
    """The model's reasoning in an earlier answer, given back with the conversation (it is not shown
    to the model again: chat templates drop earlier turns' reasoning)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: ItemStatus | None = None


InputItem = InputMessage | FunctionCallInput | FunctionCallOutputInput | ReasoningInput


# -- tools and structured output ----------------------------------------------------------------------
class FunctionTool(OpenAIBaseModel):
    """A function the model may call, in the Responses API's flat shape."""

    type: Literal["function"] = "function"
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="The arguments' JSON schema.")
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _only_functions(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type", "function") != "function":
            raise ValueError(f"tool type {value.get('type')!r} is not supported: this server runs function tools only")
        return value


class FunctionToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    name: str


ToolChoice = Literal["none", "auto", "required"] | FunctionToolChoice


class TextFormat(OpenAIBaseModel):
    """``text.format``: plain text, any JSON object, or JSON under a schema."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    # NOTE: "schema" would shadow a pydantic BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(
        default=None, alias="schema", description="The JSON schema (json_schema)."
    )
    description: str | None = None
    strict: bool | None = None


class TextConfig(OpenAIBaseModel):
    format: TextFormat = Field(default_factory=TextFormat)


class ReasoningConfig(OpenAIBaseModel):
    """``reasoning``: how hard a reasoning model thinks (``effort`` reaches the chat template)."""

    effort: ReasoningEffort | None = None
    summary: str | None = Field(default=None, description="Accepted; the reasoning is returned whole, not summarised.")


# -- request -------------------------------------------------------------------------------
class ResponsesRequest(OpenAIBaseModel):
    """``POST /v1/responses``; fields OpenAI defines that this server does not use are ignored."""

    model: str | None = Field(default=None, description="The served model name; defaults to it.")
    input: str | list[InputItem] = Field(..., description="A user message as a string, or input items.")
    instructions: str | None = Field(default=None, description="A system message placed first (not carried over).")
    max_output_tokens: int | None = Field(
        default=None, ge=1, description="Most tokens to generate; null = up to max_model_len."
    )
    temperature: float | None = Field(default=None, description="Default: the model's generation_config, else 1.0.")
    top_p: float | None = Field(default=None, description="Default: the model's generation_config, else 1.0.")
    stream: bool | None = False
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    previous_response_id: str | None = Field(
        default=None, description="Continue the conversation of a stored response."
    )
    store: bool | None = Field(default=True, description="Keep the response for previous_response_id and GET.")
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None, max_length=16)
    user: str | None = None
    cache_salt: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="Prefix-cache blocks are shared only between requests with the same salt.",
    )
    structured_outputs: dict[str, Any] | None = Field(
        default=None,
        description="One of json, regex, choice, grammar, json_object, as chat's structured_outputs "
        "(or text.format, not both).",
    )
    reasoning: ReasoningConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description='Extra variables for the chat template, e.g. {"enable_thinking": false} (Qwen3), as on chat.',
    )


# -- response -------------------------------------------------------------------------------
class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class FunctionCall(OpenAIBaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus = "completed"


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(OpenAIBaseModel):
    """The model's reasoning (with ``--reasoning-parser``), before its answer."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = Annotated[OutputMessage | FunctionCall | ReasoningItem, Field(discriminator="type")]


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens"]


class ResponsesResponse(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: ResponseStatus
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = Field(
        default=None,
        description="Always null: a request that fails gets an HTTP error, or an error event on its stream.",
    )
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig = Field(default_factory=TextConfig)
    tool_choice: ToolChoice = "auto"
    tools: list[FunctionTool] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    user: str | None = None
