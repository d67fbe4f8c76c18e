"""``pagedllm serve``: the OpenAI-compatible server on uvicorn, with a graceful SIGTERM drain.

On SIGTERM the server stops admitting (``/ready`` turns 503, new requests get 503 with
``Retry-After``), lets in-flight requests finish for up to ``--drain-timeout`` seconds,
aborts what is left, then exits 0 — so a Kubernetes rolling update never cuts a stream.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import operator
import os
import signal
import socket
import sys
import time

from pagedllm.server.args import add_engine_args, as_flag_error, engine_config_from_args
from pagedllm.server.config import ConfigError
from pagedllm.server.entrypoints.headless import add_headless_arg, check_node_role, run_headless
from pagedllm.server.entrypoints.openai.reasoning_parser import REASONING_PARSERS
from pagedllm.server.entrypoints.openai.settings import (
    CACHE_SALT_POLICIES,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_RESPONSES_STORE_SIZE,
    ENGINE_CORE_MODES,
)
from pagedllm.server.entrypoints.openai.tool_formats import TOOL_CALL_PARSERS

API_KEY_ENV = "PAGEDLLM_API_KEY"
LORA_MODULES_ENV = "PAGEDLLM_LORA_MODULES"
"""Whitespace-separated NAME=PATH adapters, read when --lora-modules is not given (the operator sets it
from a ConfigMap, so its pods start with the current adapters without the list being in the pod spec)."""
SERVE_DESCRIPTION = (
    "Serve the OpenAI-compatible HTTP API. On SIGTERM or a first Ctrl-C the server stops admitting "
    "(/ready turns 503, new requests get 503 with Retry-After), lets in-flight requests finish for up to "
    "--drain-timeout seconds, then exits 0."
)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
SERVER_FLAGS = {  # ServerSettings field -> flag, for error messages
    "max_queue_len": "--max-waiting-requests",
    "request_timeout": "--request-timeout",
    "max_body_bytes": "--max-request-body-bytes",
    "drain_timeout": "--drain-timeout",
    "api_key": "--api-key",
    "responses_store_size": "--responses-store-size",
    "tool_call_parser": "--tool-call-parser",
    "enable_auto_tool_choice": "--enable-auto-tool-choice",
    "reasoning_parser": "--reasoning-parser",
}

logger = logging.getLogger("pagedllm.serve")


def add_serve_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="Serve the OpenAI-compatible HTTP API (the embedded demo model without --model).",
        description=SERVE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # NOTE: no abbreviations: `--tensor-parallel 4` through extraArgs would otherwise set a
        # flag the operator renders from the spec (and renders again after it).
        allow_abbrev=False,
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="The model to serve, as `vllm serve MODEL` takes it: the same as --model (give one of them).",
    )
    add_server_args(p)
    add_headless_arg(p.add_argument_group("nodes"))
    add_engine_args(p)
    p.set_defaults(func=run_serve)
    return p


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="0.0.0.0", help="Address to listen on (default: 0.0.0.0).")
    group.add_argument("--port", type=int, default=8000, help="Port to listen on (default: 8000).")
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="Model name(s) clients pass as 'model'; the first is reported "
        "(default: the --model path, or pagedllm-demo).",
    )
    group.add_argument(
        "--api-key",
        default=None,
        help=f"Require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, else none).",
    )
    group.add_argument(
        "--max-waiting-requests",
        "--max-queue-len",
        dest="max_queue_len",
        type=int,
        default=None,
        help="Most requests waiting to be scheduled; more get 503 + Retry-After and count in "
        "pagedllm:requests_rejected_total (default: 4 x --max-num-seqs). /ready stays 200 meanwhile: "
        "overload is not ill health.",
    )
    group.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="Seconds a request may run before it is aborted with 504 (default: no limit).",
    )
    group.add_argument(
        "--max-request-body-bytes",
        dest="max_body_bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"Largest request body accepted; larger ones get 413 (default: {DEFAULT_MAX_BODY_BYTES}).",
    )
    group.add_argument(
        "--cache-salt-policy",
        choices=CACHE_SALT_POLICIES,
        default="optional",
        help="Prefix-cache isolation between tenants: requests may give a cache_salt (optional), must "
        "(required), or get one derived from their API key (api-key) (default: optional).",
    )
    group.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="Seconds SIGTERM waits for in-flight requests before aborting them (default: 30).",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        help="Jinja chat template, as a file path or the template text (default: the tokenizer's).",
    )
    group.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help=f"The format tool_choice=auto reads the model's calls in: one of {', '.join(TOOL_CALL_PARSERS)} "
        "(default: Hermes <tool_call> and LLaMA-3 JSON, both).",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="Accepted as vLLM takes it (with --tool-call-parser); tool_choice=auto is always served.",
    )
    group.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help=f"How the model marks its reasoning: one of {', '.join(REASONING_PARSERS)}; chat answers then carry "
        "it as reasoning_content, apart from content (default: none, all text is content).",
    )
    group.add_argument(
        "--responses-store-size",
        type=int,
        default=DEFAULT_RESPONSES_STORE_SIZE,
        help="Most /v1/responses answers kept in memory for previous_response_id, least recently used out "
        f"first; 0 keeps none (default: {DEFAULT_RESPONSES_STORE_SIZE}).",
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters to serve (with --enable-lora): a request's model picks one by NAME; PATH is a "
        'PEFT directory; vLLM\'s JSON form {"name": ..., "path": ...} is read too '
        f"(default: ${LORA_MODULES_ENV}, whitespace-separated NAME=PATH, or none).",
    )
    group.add_argument(
        "--engine-core",
        choices=ENGINE_CORE_MODES,
        default="process",
        help="Where the engine (scheduler, model, sampler) runs: 'process', an engine-core process of its own, "
        "so HTTP, tokenization and streaming never wait for a model step; or 'thread', a thread of the server "
        "process (default: process).",
    )
    group.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="Logging level (default: info).")
    group.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="No access-log line per request (by default: id, status, prompt and output tokens, latency).",
    )
    return parser


def settings_from_args(args: argparse.Namespace):
    """:class:`ServerSettings` from parsed flags; a bad value raises ``ValueError`` naming the flag."""
    from pagedllm.server.entrypoints.openai.serving_lora import parse_lora_modules, runtime_updates_allowed
    from pagedllm.server.entrypoints.openai.settings import ServerSettings

    if not 0 <= args.port <= 65535:
        raise ConfigError("port", args.port, "must be 0-65535", problem="is out of range", name="--port")
    try:
        return ServerSettings(
            served_model_names=list(args.served_model_name or []),
            api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV),
            max_queue_len=args.max_queue_len,
            request_timeout=args.request_timeout,
            max_body_bytes=args.max_body_bytes,
            cache_salt_policy=args.cache_salt_policy,
            responses_store_size=args.responses_store_size,
            log_requests=not args.disable_log_requests,
            drain_timeout=args.drain_timeout,
            chat_template=load_chat_template(args.chat_template),
            lora_modules=parse_lora_modules(args.lora_modules or os.environ.get(LORA_MODULES_ENV, "").split()),
            allow_runtime_lora_updating=runtime_updates_allowed(),
            engine_core=args.engine_core,
            tool_call_parser=args.tool_call_parser,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            reasoning_parser=args.reasoning_parser,
        )
    except ConfigError as exc:
        raise exc.renamed(SERVER_FLAGS.get(exc.field, exc.name)) from exc


def load_chat_template(value: str | None) -> str | None:
    """A template given as a file path or inline; a path that does not exist is an error."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError(
        "chat_template",
        value,
        "give a path or the text",
        problem="is neither a file nor a Jinja template",
        name="--chat-template",
    )


def check_port_free(host: str, port: int) -> None:
    """Refuse a port another process already listens on."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(
                "port",
                port,
                f"stop the other server or pick another port ({exc.strerror})",
                problem=f"is already in use on {host}",
                name="--port",
            ) from exc


def keep_torch_out() -> None:
    """Mark torch absent from this process: with the engine core in its own process, the API
    server needs none (tokenizer, templates, grammar checks, HTTP and metrics are torch-free).

    NOTE: transformers imports torch whenever it is installed (its config module loads its RoPE
    helpers), which would cost this process hundreds of MB and seconds of start-up; with
    ``sys.modules["torch"] = None`` it finds torch unavailable and leaves it out. The engine core
    is a spawned interpreter with modules of its own. Nothing changes if torch is already loaded.
    Transformers' notice that it found no PyTorch, which would open every server's log, is dropped.
    """
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]
        logging.getLogger("transformers").addFilter(_drop_torch_absent_notice)


def _drop_torch_absent_notice(record: logging.LogRecord) -> bool:
    """False for transformers' import-time notice that PyTorch was not found (left out on purpose here)."""
    return not record.getMessage().startswith("PyTorch was not found")


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedllm.server.entrypoints.openai.api_server import build_app
    from pagedllm.server.hf_config import read_hf_config

    config = engine_config_from_args(args)
    check_node_role(config, args.headless)
    if args.headless:
        return run_headless(config, args.log_level)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    if settings.engine_core == "process":
        keep_torch_out()
    check_port_free(args.host, args.port)  # NOTE: before the model loads, not minutes later
    if config.model.model is not None:
        try:
            read_hf_config(config.model.model)  # NOTE: fail now, not after the port is open
        except ValueError as exc:
            raise ConfigError(
                "model", config.model.model, str(exc), problem="is not a model directory", name="--model"
            ) from exc
    app = build_app(config, settings)
    server = draining_server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
            access_log=False,  # NOTE: our own access line says more (tokens, latency)
            log_config=None,  # NOTE: uvicorn's lines go through our handler, in our format, once
        ),
        app.state,
        settings.drain_timeout,
    )
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down for
        pass
    error = server.load_error
    if error is not None:
        shown = as_flag_error(error) if isinstance(error, ConfigError) else error
        raise ValueError(f"the engine failed to start: {shown}")
    if server.runtime_error is not None:
        return 1
    return 0


def draining_server(config, state, drain_timeout: float):
    """A uvicorn server whose SIGTERM drains first (see the module docstring)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        load_error: BaseException | None = None
        runtime_error: BaseException | None = None

        def handle_exit(self, sig, frame) -> None:
            # NOTE: SIGTERM and a first Ctrl-C drain; they are not recorded, so uvicorn does not
            # re-raise them and the process exits 0. A second Ctrl-C stops at once.
            if sig in (signal.SIGTERM, signal.SIGINT) and not self.should_exit:
                if not state.serving.draining:
                    state.serving.draining = True
                    if sig == signal.SIGINT:
                        logger.warning(
                            "Ctrl-C: finishing %d request(s) first; Ctrl-C again stops at once",
                            state.engine.num_unfinished,
                        )
                    self._loop.call_soon_threadsafe(self._begin_drain)
                    return
                if sig == signal.SIGTERM:
                    return
                self.force_exit = True  # the second Ctrl-C
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            self._tasks: set[asyncio.Future[None]] = set()
            await super().startup(sockets)
            self._spawn(self._watch_engine())

        def _spawn(self, coro) -> None:
            task = asyncio.ensure_future(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        def _begin_drain(self) -> None:
            self._spawn(self._drain_then_exit())

        async def _drain_then_exit(self) -> None:
            engine = state.engine
            logger.info("draining %d request(s), up to %.0fs", engine.num_unfinished, drain_timeout)
            deadline = time.monotonic() + drain_timeout
            while engine.num_unfinished and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if engine.num_unfinished:
                count = engine.abort_all("the server shut down before the request finished (--drain-timeout)")
                logger.warning("drain timeout: aborted %d request(s)", count)
            self.should_exit = True

        async def _watch_engine(self) -> None:
            try:
                await state.engine.wait_until_ready()
            except Exception as exc:  # noqa: BLE001 (reported by run_serve)
                self.load_error = exc
                self.should_exit = True
                return
            logger.info(
                "%s", await state.engine.call(operator.methodcaller("describe", self.config.host, self.config.port))
            )
            # NOTE: a dead engine cannot serve again: exit non-zero so Kubernetes restarts the pod.
            while state.engine.error is None:
                await asyncio.sleep(0.1)
            self.runtime_error = state.engine.error
            logger.error("the engine died (%r): exiting", self.runtime_error)
            self.should_exit = True

    return DrainingServer(config)
