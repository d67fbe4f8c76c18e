"""LoRA adapters over HTTP: a request's ``model`` names an adapter, ``/v1/models`` lists them, and,
when the operator of the server allows it, adapters are loaded and unloaded at run time.

::

    pagedllm serve --model base --enable-lora --lora-modules sql=/adapters/sql chat=/adapters/chat
    POST /v1/completions {"model": "sql", ...}          -> runs with the sql adapter
    GET  /v1/models                                      -> base, sql (parent base), chat (parent base)
    POST /v1/load_lora_adapter   {"lora_name", "lora_path"}   only with PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=true
    POST /v1/unload_lora_adapter {"lora_name"}

Each adapter gets an id of its own when it is registered; ids are never reused, so an
adapter loaded again under an old name never meets the old one's prefix-cache blocks.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from operator import methodcaller

from fastapi.responses import PlainTextResponse

from pagedllm.server.config import ConfigError
from pagedllm.server.entrypoints.openai.errors import APIError, bad_request, from_config_error
from pagedllm.server.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from pagedllm.server.lora_request import LoRARequest

RUNTIME_LORA_ENV = "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING"
"""``true`` / ``1`` enables ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``."""


def runtime_updates_allowed(environ: dict[str, str] | None = None) -> bool:
    value = (environ if environ is not None else os.environ).get(RUNTIME_LORA_ENV, "")
    return value.strip().lower() in ("1", "true", "yes")


def parse_lora_modules(values: list[str]) -> dict[str, str]:
    """``--lora-modules`` values, ``name=path`` or vLLM's JSON ``{"name": ..., "path": ...}``: name -> path."""
    modules: dict[str, str] = {}
    for value in values:
        name, path = _one_module(value)
        if name in modules:
            raise ConfigError("lora_modules", value, "give each adapter its own name", problem="repeats a name")
        modules[name] = path
    return modules


def _one_module(value: str) -> tuple[str, str]:
    if value.lstrip().startswith("{"):
        try:
            item = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError("lora_modules", value, f"name=path or a JSON object ({exc.msg})") from exc
        name, path = item.get("name"), item.get("path")
    else:
        name, _, path = value.partition("=")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ConfigError("lora_modules", value, "name=path, e.g. sql=/adapters/sql")
    return name, path


@dataclass
class LoRAModules:
    """The adapters this server serves, by the name clients give as ``model``."""

    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1), repr=False)

    @classmethod
    def of(cls, modules: dict[str, str]) -> LoRAModules:
        registry = cls()
        for name, path in modules.items():
            registry.register(registry.make(name, path))
        return registry

    def make(self, name: str, path: str) -> LoRARequest:
        """A request for the adapter at ``path`` under a fresh id (not yet served: see :meth:`register`)."""
        return LoRARequest(name, next(self._ids), path)

    def register(self, request: LoRARequest) -> None:
        """Serve ``request``'s adapter as ``model=request.lora_name`` (the caller checked it fits the model)."""
        self.adapters[request.lora_name] = request

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    def remove(self, name: str) -> LoRARequest | None:
        return self.adapters.pop(name, None)

    @property
    def names(self) -> list[str]:
        return list(self.adapters)


def add_lora_routes(app, serving) -> None:
    """``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (only called when runtime updates are allowed)."""

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> str:
        serving.check_ready()
        name = body.lora_name
        if name in serving.served_model_names or serving.loras.get(name) is not None:
            raise bad_request(f"The lora adapter `{name}` has already been loaded: unload it first", "lora_name")
        try:
            request = serving.loras.make(name, body.lora_path)
            await serving.engine.call(methodcaller("add_lora", request))
        except ConfigError as exc:
            raise from_config_error(exc, {"lora_request": "lora_path", "lora_name": "lora_name"}) from exc
        serving.loras.register(request)
        return f"Success: LoRA adapter '{name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> str:
        serving.check_ready()
        request = serving.loras.get(body.lora_name)
        if request is None:
            raise APIError(
                404,
                f"The lora adapter `{body.lora_name}` cannot be found: loaded are {serving.loras.names}",
                param="lora_name",
                code="model_not_found",
                type="not_found_error",
            )
        if not await serving.engine.call(methodcaller("remove_lora", request.lora_int_id)):
            raise bad_request(f"The lora adapter `{body.lora_name}` is in use by running requests: retry later")
        serving.loras.remove(body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
