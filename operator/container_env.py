"""The server and download containers' environment (Hub token and cache, API key, user env).

NOTE: download credentials (HF_TOKEN, spec.modelSource.credentialsSecret) go to the container
that downloads (fetch-model, or the cache Job's) and nowhere else: the server only reads local
files, and a token in its environment would be one more place to leak it from (a debug
endpoint, a crash dump, ``kubectl exec env``).
"""

from __future__ import annotations

from pagedllm.operator.adapters import DOWNLOADS_ENV, LORA_MODULES_ENV, RUNTIME_LORA_ENV
from pagedllm.operator.command import API_KEY_ENV
from pagedllm.operator.spec import PagedLLMSpec, SecretKeyRef, SpecError

HF_HOME = "/models/.hf"


def _secret_env(var: str, ref: SecretKeyRef) -> dict:
    return {"name": var, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def hub_env(spec: PagedLLMSpec, *, downloads: bool) -> list[dict]:
    """The Hub cache, and the Hub token where the container ``downloads``."""
    env = [_secret_env("HF_TOKEN", spec.hf_token_secret)] if downloads and spec.hf_token_secret else []
    if spec.downloads:
        env.append({"name": "HF_HOME", "value": HF_HOME})
    return env


def server_env(spec: PagedLLMSpec) -> list[dict]:
    """The server's environment: the Hub cache's location, the API key, spec.env; no download credentials."""
    env = hub_env(spec, downloads=False)
    if spec.api_key_secret:
        env.append(_secret_env(API_KEY_ENV, spec.api_key_secret))
    reserved = {e["name"] for e in env} | {"HF_TOKEN", "HF_HOME", API_KEY_ENV}
    reserved |= {LORA_MODULES_ENV, RUNTIME_LORA_ENV, DOWNLOADS_ENV}
    for index, extra in enumerate(spec.env):
        if extra["name"] in reserved:
            raise SpecError(
                f"spec.env[{index}].name={extra['name']!r} is not allowed: the operator sets it "
                "(use hfTokenSecret or apiKeySecret)"
            )
        env.append(dict(extra))
    return env
