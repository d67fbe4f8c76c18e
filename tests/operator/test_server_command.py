"""The server command line the operator renders, parsed by the real `pagedllm` CLI.

The container runs ``SERVE_COMMAND + args``; here the same words go through
``pagedllm.server.entrypoints.cli.build_parser()`` (the console script's parser), so every rendered
flag must exist in `pagedllm serve` with the type and meaning the operator assumes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from pagedllm.operator.command import (
    ENGINE_FIELDS,
    OWNED_FLAGS,
    SERVE_COMMAND,
    SERVE_FIELDS,
    check_engine,
    server_args,
    spec_attr,
)
from pagedllm.operator.spec import LOG_LEVELS, PagedLLMSpec, SpecError
from pagedllm.server.args import engine_kwargs, flag_for
from pagedllm.server.config import EngineConfig, SpeculativeConfig
from pagedllm.server.entrypoints import serve
from pagedllm.server.entrypoints.cli import build_parser


def run_as_container(args: list[str]) -> argparse.Namespace:
    """Parse ``pagedllm serve ARGS`` exactly as the container's command line would be."""
    assert SERVE_COMMAND[0] == "pagedllm"
    return build_parser().parse_args([*SERVE_COMMAND[1:], *args])


FULL_SPEC = {
    "model": "org/model",
    "replicas": 2,
    "tensorParallelSize": 4,
    "blockSize": 32,
    "gpuMemoryUtilization": 0.85,
    "maxNumSeqs": 64,
    "maxNumBatchedTokens": 8192,
    "maxModelLen": 4096,
    "swapSpaceGiB": 2.5,
    "dtype": "bfloat16",
    "enablePrefixCaching": False,
    "preemptionMode": "swap",
    "seed": 7,
    "loadFormat": "safetensors",
    "servedModelName": "my-model",
    "port": 9000,
    "drainTimeoutSeconds": 45,
    "maxQueueLen": 100,
    "logLevel": "debug",
}


def parse(spec: dict, model_path: str = "/models/org/model") -> argparse.Namespace:
    return run_as_container(server_args(PagedLLMSpec.from_dict(spec), model_path))


def test_every_engine_field_reaches_its_flag():
    namespace = parse(FULL_SPEC)
    spec = PagedLLMSpec.from_dict(FULL_SPEC)
    for key, field in ENGINE_FIELDS.items():
        expected = "/models/org/model" if key == "model" else getattr(spec, spec_attr(key))
        assert getattr(namespace, field) == expected, key
    EngineConfig.from_kwargs(**engine_kwargs(namespace))  # the engine takes what was rendered


def test_every_serve_field_reaches_its_flag():
    namespace = parse(FULL_SPEC)
    assert namespace.port == 9000 and namespace.host == "0.0.0.0"
    assert namespace.served_model_name == ["my-model"]
    assert namespace.drain_timeout == 45 and namespace.max_queue_len == 100 and namespace.log_level == "debug"
    assert namespace.api_key is None  # the key comes from the environment, never argv


def test_defaults_render_to_the_engine_defaults():
    namespace = parse({"model": "org/model"})
    defaults = EngineConfig.from_kwargs()
    assert namespace.block_size == defaults.cache.block_size
    assert namespace.enable_prefix_caching is defaults.cache.enable_prefix_caching
    assert namespace.max_num_seqs == defaults.scheduler.max_num_seqs
    assert namespace.preemption_mode is None and namespace.max_model_len is None
    assert namespace.served_model_name == ["org/model"]


@pytest.mark.parametrize("value, flag", [(True, "--enable-prefix-caching"), (False, "--no-enable-prefix-caching")])
def test_booleans_render_both_ways(value, flag):
    args = server_args(PagedLLMSpec.from_dict({"model": "m", "enablePrefixCaching": value}), "/m")
    assert flag in args


def test_flags_come_from_flag_for():
    assert flag_for(ENGINE_FIELDS["blockSize"]) == "--block-size"
    serve_flags = {
        opt for action in serve.add_server_args(argparse.ArgumentParser())._actions for opt in action.option_strings
    }
    assert set(SERVE_FIELDS.values()) | {"--host", "--api-key"} <= serve_flags
    for flag in OWNED_FLAGS:
        assert flag.startswith("--")


def test_extra_args_are_appended():
    spec = PagedLLMSpec.from_dict({"model": "m", "extraArgs": ["--num-gpu-blocks-override", "64"]})
    args = server_args(spec, "/m")
    assert args[-2:] == ["--num-gpu-blocks-override", "64"]
    assert run_as_container(args).num_gpu_blocks_override == 64


@pytest.mark.parametrize(
    "arg, owner",
    [
        ("--block-size", "spec.blockSize"),
        ("--block-size=64", "spec.blockSize"),
        ("--no-enable-prefix-caching", "spec.enablePrefixCaching"),
        ("--port", "spec.port"),
        ("--api-key", "spec.apiKeySecret"),
        ("--host", "the operator"),
        ("--model", "spec.model"),
    ],
)
def test_extra_args_cannot_set_owned_flags(arg, owner):
    spec = PagedLLMSpec.from_dict({"model": "m", "extraArgs": [arg, "x"]})
    with pytest.raises(SpecError, match="set that instead") as info:
        server_args(spec, "/m")
    assert owner in str(info.value) and "spec.extraArgs[0]" in str(info.value)


def test_the_engine_refusing_a_value_names_the_spec_key():
    # A value past the CRD (a power-of-two check it cannot express), refused by the engine.
    spec = dataclasses.replace(PagedLLMSpec.from_dict({"model": "m"}), block_size=24)
    with pytest.raises(SpecError, match=r"^spec\.blockSize=24"):
        check_engine(spec, "/m")


def test_server_defaults_agree_with_the_crd(crd_schema):
    props = crd_schema["properties"]["spec"]["properties"]
    defaults = run_as_container([])
    assert defaults.port == props["port"]["default"]
    assert defaults.drain_timeout == props["drainTimeoutSeconds"]["default"]
    assert defaults.log_level == props["logLevel"]["default"]
    assert set(LOG_LEVELS) <= set(serve.LOG_LEVELS)


def test_api_key_variable_is_the_one_the_server_reads():
    from pagedllm.operator.command import API_KEY_ENV

    assert API_KEY_ENV == serve.API_KEY_ENV


def test_speculative_config_passes_through_as_its_json_flag():
    value = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    args = server_args(PagedLLMSpec.from_dict({"model": "m", "speculativeConfig": value}), "/m")
    assert args[args.index("--speculative-config") + 1] == json.dumps(value, sort_keys=True)
    config = EngineConfig.from_kwargs(**engine_kwargs(run_as_container(args)))
    assert config.scheduler.speculative_config == SpeculativeConfig(
        "ngram", 3, prompt_lookup_max=4, prompt_lookup_min=4
    )
    assert "--speculative-config" not in server_args(PagedLLMSpec.from_dict({"model": "m"}), "/m")


def test_a_bad_speculative_config_is_refused_under_its_spec_path():
    spec = PagedLLMSpec.from_dict(
        {"model": "m", "speculativeConfig": {"method": "ngram", "num_speculative_tokens": 99}}
    )
    with pytest.raises(SpecError) as info:
        check_engine(spec, "/m")
    assert str(info.value).startswith("spec.speculativeConfig.num_speculative_tokens=99 is out of range")
