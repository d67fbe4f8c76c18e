"""The HTTP server: FastAPI routes, OpenAI-shaped errors, auth, health, metrics and draining.

``build_app(config, settings)`` returns the ASGI app; :mod:`pagedllm.server.entrypoints.serve` runs it
with uvicorn. The engine starts in the app's lifespan and loads the model on its own
thread, so ``/health`` answers at once and ``/ready`` turns true after a first forward pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.server.config import ConfigError, EngineConfig
from pagedllm.server.config.quantization import WeightsSummary
from pagedllm.server.engine.async_engine import AsyncLLMEngine
from pagedllm.server.entrypoints.openai.errors import (
    APIError,
    bad_request,
    error_response,
    validation_error,
)
from pagedllm.server.entrypoints.openai.metrics import ServerMetrics
from pagedllm.server.entrypoints.openai.middleware import BodyLimitMiddleware, GateMiddleware
from pagedllm.server.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from pagedllm.server.entrypoints.openai.protocol_responses import ResponsesRequest, ResponsesResponse
from pagedllm.server.entrypoints.openai.response_store import ResponseStore
from pagedllm.server.entrypoints.openai.serving import OpenAIServing, RequestContext, access_log
from pagedllm.server.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.server.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.server.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedllm.server.entrypoints.openai.serving_lora import LoRAModules, add_lora_routes
from pagedllm.server.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.server.entrypoints.openai.settings import ServerSettings
from pagedllm.server.version import package_version

logger = logging.getLogger("pagedllm.api_server")
MAX_REQUEST_ID_LEN = 128
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 404, 503)}
SSE_CONTENT = {"text/event-stream": {"schema": {"type": "string"}}}
# NOTE: the Responses API names its events (``event:`` lines), so each is an event name and its data.
NAMED_SSE_CONTENT = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
            "required": ["event", "data"],
        }
    }
}
"""The other body a 200 of a streaming endpoint may have: ``stream=true`` answers with server-sent events."""


def default_model_name(config: EngineConfig) -> str:
    return config.model.model or "pagedllm-demo"


def build_app(config: EngineConfig, settings: ServerSettings | None = None) -> FastAPI:
    """The ASGI app; ``app.state.serving`` / ``.engine`` / ``.metrics`` expose the parts (tests use them)."""
    settings = settings or ServerSettings()
    if settings.lora_modules and not config.lora.enable_lora:
        raise ConfigError(
            "lora_modules", sorted(settings.lora_modules), "add --enable-lora", problem="needs LoRA, which is off"
        )
    names = settings.served_model_names or [default_model_name(config)]
    engine = make_engine(config, settings)
    metrics = ServerMetrics(names[0], config, engine.stats, lambda: _loaded_weights(engine))
    engine.observer = metrics.observe
    max_waiting = settings.max_queue_len or 4 * config.scheduler.max_num_seqs
    serving = OpenAIServing(
        engine,
        names,
        settings.chat_template,
        max_waiting,
        settings.cache_salt_policy,
        request_timeout=settings.request_timeout,
        on_reject=metrics.count_rejected,
        log_requests=settings.log_requests,
        loras=LoRAModules.of(settings.lora_modules),
        on_lora_request=metrics.count_lora_request,
        tool_call_parser=settings.tool_call_parser,
        reasoning_parser=settings.reasoning_parser,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="PagedLLM OpenAI-compatible API", version=package_version(), lifespan=lifespan)
    app.state.settings, app.state.engine, app.state.serving, app.state.metrics = settings, engine, serving, metrics
    app.add_middleware(GateMiddleware, serving=serving, api_key=settings.api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    _add_error_handlers(app)
    _add_openai_routes(app, serving)
    _add_responses_routes(
        app, OpenAIServingResponses(OpenAIServingChat(serving), ResponseStore(settings.responses_store_size))
    )
    _add_ops_routes(app, serving, metrics)
    if settings.allow_runtime_lora_updating and config.lora.enable_lora:
        add_lora_routes(app, serving)
    return app


def _loaded_weights(engine: AsyncLLMEngine) -> WeightsSummary | None:
    """The engine's weights as they run (``quant_config_info``), once it has loaded them."""
    return engine.model_info.weights if engine.model_info is not None else None


def make_engine(config: EngineConfig, settings: ServerSettings) -> AsyncLLMEngine:
    """The async engine ``settings.engine_core`` asks for: in an engine-core process, or on a thread here."""
    if settings.engine_core == "process":
        from pagedllm.server.engine.core_client import MultiprocessAsyncEngine

        return MultiprocessAsyncEngine(config, warmup=settings.warmup)
    return AsyncLLMEngine(config, warmup=settings.warmup)


# -- routes ---------------------------------------------------------------------------------------
def _add_openai_routes(app: FastAPI, serving: OpenAIServing) -> None:
    completion, chat = OpenAIServingCompletion(serving), OpenAIServingChat(serving)
    names = serving.served_model_names

    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def list_models() -> ModelList:
        info = serving.engine.model_info
        max_len = info.max_model_len if info else None
        base = [ModelCard(id=name, root=info.model_dir if info else None, max_model_len=max_len) for name in names]
        parent = serving.model_name
        adapters = [
            ModelCard(id=lora.lora_name, root=lora.lora_path, parent=parent, max_model_len=max_len)
            for lora in serving.loras.adapters.values()
        ]
        return ModelList(data=base + adapters)

    @app.post(
        "/v1/completions", responses={200: {"model": CompletionResponse, "content": SSE_CONTENT}, **ERROR_RESPONSES}
    )
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await until_disconnected(request, completion.create(body, request_context(request)))

    @app.post(
        "/v1/chat/completions",
        responses={200: {"model": ChatCompletionResponse, "content": SSE_CONTENT}, **ERROR_RESPONSES},
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await until_disconnected(request, chat.create(body, request_context(request)))

    embedding = OpenAIServingEmbedding(serving)

    @app.post("/v1/embeddings", responses={200: {"model": EmbeddingResponse}, **ERROR_RESPONSES})
    async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
        return await until_disconnected(request, embedding.create(body, request_context(request)))

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        serving.check_model(body.model)
        serving.check_ready()
        tokenizer = serving.need_tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            tokens = chat.prompt(body.messages, body.add_generation_prompt).token_ids
        else:
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=serving.model_info.max_model_len, tokens=tokens)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        serving.check_model(body.model)
        serving.check_ready()
        tokenizer = serving.need_tokenizer()
        serving.check_token_ids(body.tokens, "tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(body.tokens))


def _add_responses_routes(app: FastAPI, responses: OpenAIServingResponses) -> None:
    @app.post(
        "/v1/responses", responses={200: {"model": ResponsesResponse, "content": NAMED_SSE_CONTENT}, **ERROR_RESPONSES}
    )
    async def create_response(body: ResponsesRequest, request: Request) -> Any:
        return await until_disconnected(request, responses.create(body, request_context(request)))

    @app.get("/v1/responses/{response_id}", response_model=ResponsesResponse, responses=ERROR_RESPONSES)
    async def retrieve_response(response_id: str) -> ResponsesResponse:
        return responses.retrieve(response_id)


def _add_ops_routes(app: FastAPI, serving: OpenAIServing, metrics: ServerMetrics) -> None:
    @app.get("/")
    async def root() -> dict[str, Any]:
        """Where to go from here."""
        return {
            "name": "PagedLLM",
            "version": package_version(),
            "models": serving.served_model_names,
            "endpoints": {"docs": "/docs", "models": "/v1/models", "health": "/health", "metrics": "/metrics"},
        }

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health():
        """200 while the process and the engine thread are alive (also while the model loads)."""
        engine = serving.engine
        if engine.error is not None or (engine.model_info is not None and not engine.is_alive):
            raise APIError(503, f"the engine is dead: {engine.error!r}", type="service_unavailable")
        return {"status": "ok"}

    @app.get("/ready", responses={503: {"model": ErrorResponse}})
    async def ready():
        """200 once the model is loaded and has run a forward pass, until draining starts."""
        serving.check_ready()
        return {"status": "ready"}

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=package_version())

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={
            200: {"description": "Prometheus' text format.", "content": {"text/plain": {"schema": {"type": "string"}}}}
        },
    )
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


# -- errors ----------------------------------------------------------------------------------------
def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        access_log.info("%s %s %d %s", request.method, request.url.path, exc.status, exc.message[:200])
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(
            APIError(
                exc.status_code,
                f"{request.method} {request.url.path}: {exc.detail}",
                type=kind,
                headers=dict(exc.headers or {}),
            )
        )

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal error: {exc!r}", type="internal_server_error"))


# -- middleware and helpers ----------------------------------------------------------------------------
def request_context(request: Request) -> RequestContext:
    """What an endpoint needs from the HTTP request besides its body."""
    bearer = request.headers.get("authorization", "")
    return RequestContext(client_request_id(request), bearer.removeprefix("Bearer ").strip() or None)


def client_request_id(request: Request) -> str | None:
    """The client's ``X-Request-Id``, used as the request's id (logs, errors, response ``id``)."""
    value = request.headers.get("x-request-id")
    if value is None:
        return None
    if not 0 < len(value) <= MAX_REQUEST_ID_LEN or not value.isprintable() or not value.isascii():
        raise bad_request(
            f"X-Request-Id={value[:40]!r} is invalid: 1-{MAX_REQUEST_ID_LEN} printable ASCII characters", "X-Request-Id"
        )
    return value


async def until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work``; if the client goes away first, cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return Response(status_code=499)  # nobody is listening any more


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
