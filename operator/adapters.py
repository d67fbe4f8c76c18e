"""LoRA adapters of a ``PagedLLM``: where each one comes from, where the pod sees it, and the flags.

``spec.adapters`` lists ``{name, source}``; a request whose ``model`` is ``name`` runs with it::

    source "org/sql-lora"     a Hugging Face id: fetch-model downloads it to /models/adapters/NAME
                              (with the model, so the model must come from the Hub too)
    source "pvc:loras/sql"    a directory in spec.modelSource.pvc's claim, mounted read-only at
                              /adapters/NAME

and the server gets ``--enable-lora --lora-modules NAME=PATH ...``.
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
        return f"{PVC_ADAPTERS_DIR if self.on_pvc else HUB_ADAPTERS_DIR}/{self.name}"


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


def lora_args(adapters: tuple[Adapter, ...]) -> list[str]:
    if not adapters:
        return []
    return ["--lora-modules", *(f"{a.name}={a.path}" for a in adapters)]


def adapter_mounts(adapters: tuple[Adapter, ...]) -> list[dict]:
    """Read-only mounts of the model claim's adapter directories (the claim's volume is named ``model``)."""
    return [
        {"name": "model", "mountPath": a.path, "subPath": a.pvc_path, "readOnly": True} for a in adapters if a.on_pvc
    ]


def downloads(adapters: tuple[Adapter, ...]) -> list[str]:
    """``repo dest`` pairs for the fetch-model container."""
    return [part for a in adapters if not a.on_pvc for part in (a.source, a.path)]
