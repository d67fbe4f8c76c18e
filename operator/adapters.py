"""LoRA adapters of a ``PagedLLM``: where each one comes from, where the pod sees it, and how a pod gets it.

``spec.adapters`` lists ``{name, source}``; a request whose ``model`` is ``name`` runs with it::

    source "org/sql-lora"     a Hugging Face id: fetch-model downloads it to /models/adapters/NAME
                              (with the model, so the model must come from the Hub too)
    source "pvc:loras/sql"    a directory in spec.modelSource.pvc's claim, which is mounted whole
                              and read-only at /adapters: the server reads /adapters/loras/sql

The pod template never holds the list, so adding or removing an adapter restarts nothing:

    ConfigMap NAME-adapters   lora-modules: "sql=/adapters/loras/sql chat=/models/adapters/chat"
                              downloads:    "org/chat /models/adapters/chat"
    server container          --enable-lora, $PAGEDLLM_LORA_MODULES <- lora-modules (read at start),
                              $PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=true
    fetch-model / wait        $PAGEDLLM_ADAPTER_DOWNLOADS <- downloads (read at start)

A pod that starts reads the current list; pods already running are brought to it through the
server's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (:mod:`adapter_sync`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pagedllm.operator.spec_fields import SpecError, _list, _mapping

PVC_PREFIX = "pvc:"
HUB_ADAPTERS_DIR = "/models/adapters"
PVC_ADAPTERS_DIR = "/adapters"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_HUB_RE = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class Adapter:
    name: str
    source: str

    @property
    def on_pvc(self) -> bool:
        return self.source.startswith(PVC_PREFIX)

    @property
    def pvc_path(self) -> str:
        return self.source[len(PVC_PREFIX) :].strip("/")

    @property
    def path(self) -> str:
        """Where the server reads the adapter inside its container."""
        return f"{PVC_ADAPTERS_DIR}/{self.pvc_path}" if self.on_pvc else f"{HUB_ADAPTERS_DIR}/{self.name}"


def parse_adapters(path: str, value: Any) -> tuple[Adapter, ...]:
    adapters: list[Adapter] = []
    for index, item in enumerate(_list(path, value)):
        item = _mapping(f"{path}[{index}]", item)
        name, source = item.get("name"), item.get("source")
        if not isinstance(name, str) or not _NAME_RE.match(name) or name in {a.name for a in adapters}:
            raise SpecError(
                f"{path}[{index}].name={name!r} is not allowed: a unique name of letters, digits, '_', '.' and '-'"
            )
        adapter = Adapter(name, source if isinstance(source, str) else "")
        sub = adapter.pvc_path
        if adapter.on_pvc and (not sub or ".." in sub) or not adapter.on_pvc and not _HUB_RE.match(adapter.source):
            raise SpecError(
                f"{path}[{index}].source={source!r} is not allowed: a Hugging Face id (org/name) or "
                "pvc:<path in modelSource's claim, without '..'>"
            )
        adapters.append(adapter)
    return tuple(adapters)


def check_adapter_sources(adapters: tuple[Adapter, ...], model_from_hub: bool, model_on_pvc: bool) -> None:
    """Hub adapters download beside a Hub model; pvc adapters come from the model's claim."""
    for index, adapter in enumerate(adapters):
        if adapter.on_pvc and not model_on_pvc:
            raise SpecError(f"spec.adapters[{index}].source={adapter.source!r} needs spec.modelSource.type pvc")
        if not adapter.on_pvc and not model_from_hub:
            raise SpecError(
                f"spec.adapters[{index}].source={adapter.source!r} is downloaded with the model: the model must "
                "come from the Hugging Face Hub too (or use pvc:<path>)"
            )


def check_lora_switch(enable: bool | None, adapters: tuple[Adapter, ...], sizes: tuple[int | None, ...]) -> None:
    """Adapters and LoRA sizes need LoRA on: refuse ``enableLora: false`` beside them."""
    if enable is False and adapters:
        raise SpecError("spec.enableLora=False is not allowed with spec.adapters: remove the adapters or enableLora")
    if enable is False and any(size is not None for size in sizes):
        raise SpecError("spec.enableLora=False is not allowed with spec.maxLoras or spec.maxLoraRank: they size LoRA")


# The server's variables (pagedllm.server.entrypoints: serve, openai.serving_lora, download); a test checks them.
LORA_MODULES_ENV = "PAGEDLLM_LORA_MODULES"
RUNTIME_LORA_ENV = "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING"
DOWNLOADS_ENV = "PAGEDLLM_ADAPTER_DOWNLOADS"
MODULES_KEY, DOWNLOADS_KEY = "lora-modules", "downloads"


def config_map_name(name: str) -> str:
    return f"{name}-adapters"


def render_adapters_config_map(name: str, adapters: tuple[Adapter, ...], lora_enabled: bool) -> dict | None:
    """The adapter list new pods read at start; ``None`` while LoRA is off."""
    if not lora_enabled:
        return None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": config_map_name(name)},
        "data": {
            MODULES_KEY: " ".join(f"{a.name}={a.path}" for a in adapters),
            DOWNLOADS_KEY: " ".join(downloads(adapters)),
        },
    }


def _from_config_map(var: str, name: str, key: str) -> dict:
    ref = {"name": config_map_name(name), "key": key, "optional": True}
    return {"name": var, "valueFrom": {"configMapKeyRef": ref}}


def server_adapter_env(name: str, lora_enabled: bool) -> list[dict]:
    """The server's adapters at start, and the run-time load/unload routes on."""
    if not lora_enabled:
        return []
    return [_from_config_map(LORA_MODULES_ENV, name, MODULES_KEY), {"name": RUNTIME_LORA_ENV, "value": "true"}]


def download_adapter_env(name: str, lora_enabled: bool) -> list[dict]:
    """The Hub adapters fetch-model (or wait-for-model) gets after the model."""
    return [_from_config_map(DOWNLOADS_ENV, name, DOWNLOADS_KEY)] if lora_enabled else []


def adapter_mounts(lora_enabled: bool) -> list[dict]:
    """The model claim (its volume is named ``model``) whole and read-only at /adapters, while LoRA is on."""
    return [{"name": "model", "mountPath": PVC_ADAPTERS_DIR, "readOnly": True}] if lora_enabled else []


def downloads(adapters: tuple[Adapter, ...]) -> list[str]:
    """``source dest`` words of the Hub adapters, for the downloads."""
    return [part for a in adapters if not a.on_pvc for part in (a.source, a.path)]


def adapter_download_args(adapters: tuple[Adapter, ...]) -> list[str]:
    """``--adapter SOURCE DEST`` for each Hub adapter: the model-cache Job's (a Job is made once per spec)."""
    pairs = downloads(adapters)
    return [arg for source, dest in zip(pairs[::2], pairs[1::2]) for arg in ("--adapter", source, dest)]
