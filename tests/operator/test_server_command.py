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
from resource_factories import CONFIG, body

from pagedllm.operator.command import (
    ENGINE_FIELDS,
    OWNED_FLAGS,
    SERVE_COMMAND,
    SERVE_FIELDS,
    check_engine,
    checked_extra_args,
    server_args,
    spec_attr,
)
from pagedllm.operator.manifests import render
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
    "kvCacheDtype": "int8",
    "quantization": "fp8",
    "preemptionMode": "swap",
    "seed": 7,
    "loadFormat": "safetensors",
    "servedModelName": "my-model",
    "port": 9000,
    "drainTimeoutSeconds": 45,
    "maxQueueLen": 100,
    "logLevel": "debug",
    "enableLora": True,
    "maxLoras": 4,
    "maxLoraRank": 32,
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
    # NOTE: the engine's block size depends on the device; a PagedLLM's pods run on GPUs
    assert namespace.block_size == defaults.cache.with_block_size("cuda").block_size == 16
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
        ("--no-enable-lora", "spec.enableLora"),
        ("--enable-lora", "spec.enableLora"),
        ("--max-loras", "spec.maxLoras"),
        ("--max-lora-rank=64", "spec.maxLoraRank"),
        ("--lora-modules", "spec.adapters"),
        ("--device", "the operator"),
        ("--nnodes", "spec.nodes"),
        ("--node-rank", "spec.nodes"),
        ("--master-addr", "spec.nodes"),
        ("--master-port", "spec.nodes"),
        ("--headless", "spec.nodes"),
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


def abbreviations(flag: str) -> list[str]:
    """Every prefix of ``flag`` argparse would expand to it (at least one letter after ``--``)."""
    return [flag[:end] for end in range(3, len(flag))]


def test_owned_flags_cover_every_spelling_of_their_destinations():
    parser = build_parser()
    (serve_parser,) = [
        p
        for a in parser._actions
        if isinstance(a, argparse._SubParsersAction)
        for n, p in a.choices.items()
        if n == "serve"
    ]
    owned_dests = {a.dest for a in serve_parser._actions if set(a.option_strings) & OWNED_FLAGS}
    spellings = {opt for a in serve_parser._actions if a.dest in owned_dests for opt in a.option_strings}
    assert spellings <= OWNED_FLAGS  # (OWNED_FLAGS also has --no- forms of non-boolean fields: no harm)


def test_every_abbreviation_of_every_owned_flag_is_refused():
    refused = 0
    for flag in sorted(OWNED_FLAGS):
        for word in [flag, *abbreviations(flag)]:
            for arg in (word, f"{word}=1"):
                # render(): what the handlers call; its SpecError is the resource's Degraded message.
                with pytest.raises(SpecError) as info:
                    render(body(extraArgs=["--enable-chunked-prefill", arg, "1"]), CONFIG)
                message = str(info.value)
                assert message.startswith(f"spec.extraArgs[1]={arg!r} is not allowed: {word} "), message
                assert flag in message and "set that instead" in message
                refused += 1
    assert refused > 500  # every flag, every prefix, with and without =value


@pytest.mark.parametrize(
    "extra, flag, owner",
    [
        (["--tensor-parallel", "4"], "--tensor-parallel-size", "spec.tensorParallelSize"),
        (["--api-ke", "k"], "--api-key", "spec.apiKeySecret"),
        (["--ho", "127.0.0.1"], "--host", "the operator"),
        (["--max-waiting=9"], "--max-waiting-requests", "spec.maxQueueLen"),
        (["--no-enable-prefix"], "--no-enable-prefix-caching", "spec.enablePrefixCaching"),
    ],
)
def test_abbreviations_name_the_flag_and_its_owner(extra, flag, owner):
    spec = PagedLLMSpec.from_dict({"model": "m", "extraArgs": extra})
    with pytest.raises(SpecError, match=f"abbreviates {flag}, rendered from {owner}; set that instead"):
        server_args(spec, "/m")


def test_ambiguous_prefixes_name_every_owned_flag_they_could_be():
    spec = PagedLLMSpec.from_dict({"model": "m", "extraArgs": ["--max-num", "4"]})
    with pytest.raises(SpecError, match="--max-num abbreviates --max-num-batched-tokens or --max-num-seqs"):
        server_args(spec, "/m")


@pytest.mark.parametrize("arg", ["--enable-chunked-prefill", "--num-gpu-blocks-override=64", "--", "value", "-x"])
def test_flags_the_spec_does_not_own_pass(arg):
    assert checked_extra_args((arg,)) == (arg,)


def test_the_server_refuses_abbreviations(capsys):
    assert run_as_container(["--tensor-parallel-size", "2"]).tensor_parallel_size == 2
    parser = build_parser()  # the console script's, once: building it takes a while
    for flag in sorted(OWNED_FLAGS):
        for word in abbreviations(flag):
            with pytest.raises(SystemExit) as info:
                parser.parse_args([SERVE_COMMAND[1], word] + ([] if flag.startswith("--no-") else ["1"]))
            assert info.value.code == 2, word
            assert "unrecognized arguments" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serv"])  # the subcommand's own name is not abbreviated either


def test_speculative_config_passes_through_as_its_json_flag():
    value = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    args = server_args(PagedLLMSpec.from_dict({"model": "m", "speculativeConfig": value}), "/m")
    assert args[args.index("--speculative-config") + 1] == json.dumps(value, sort_keys=True)
    config = EngineConfig.from_kwargs(**engine_kwargs(run_as_container(args)))
    assert config.scheduler.speculative_config == SpeculativeConfig(
        "ngram", 3, prompt_lookup_max=4, prompt_lookup_min=4
    )
    assert "--speculative-config" not in server_args(PagedLLMSpec.from_dict({"model": "m"}), "/m")


def test_a_draft_model_passes_through():
    value = {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 5}
    args = server_args(PagedLLMSpec.from_dict({"model": "m", "speculativeConfig": value}), "/m")
    config = EngineConfig.from_kwargs(**engine_kwargs(run_as_container(args)))
    assert config.scheduler.speculative_config.model == "/models/draft"
    assert config.scheduler.speculative_config.method == "draft_model"
    spec = PagedLLMSpec.from_dict({"model": "m", "speculativeConfig": {"method": "draft_model"}})
    with pytest.raises(SpecError, match="spec.speculativeConfig.model=None is required with method draft_model"):
        check_engine(spec, "/m")


def test_a_bad_speculative_config_is_refused_under_its_spec_path():
    spec = PagedLLMSpec.from_dict(
        {"model": "m", "speculativeConfig": {"method": "ngram", "num_speculative_tokens": 99}}
    )
    with pytest.raises(SpecError) as info:
        check_engine(spec, "/m")
    assert str(info.value).startswith("spec.speculativeConfig.num_speculative_tokens=99 is out of range")


RENDERINGS = [
    {"model": "org/model"},
    FULL_SPEC,
    {"model": "org/model", "adapters": [{"name": "sql", "source": "org/sql-lora"}]},
    {"model": "org/model", "nodes": 2, "tensorParallelSize": 2},
    {"model": "org/model", "apiKeySecret": {"name": "key"}, "serviceType": "LoadBalancer"},
]


@pytest.mark.parametrize("spec", RENDERINGS)
def test_every_flag_any_rendering_emits_is_owned(spec):
    manifests = render(body(**spec), CONFIG)
    workload = manifests.deployment
    templates = (
        [workload["spec"]["template"]]
        if workload["kind"] == "Deployment"
        else [workload["spec"]["leaderWorkerTemplate"][role] for role in ("leaderTemplate", "workerTemplate")]
    )
    for template in templates:
        args = template["spec"]["containers"][0]["args"]
        flags = {arg for arg in args if arg.startswith("--")}
        assert flags and flags <= OWNED_FLAGS, flags - OWNED_FLAGS


@pytest.mark.parametrize(
    "extra, at, said",
    [
        (["--enable-chunked-prefil"], 0, "unrecognized arguments: --enable-chunked-prefil"),
        (["--enable-chunked-prefill", "--num-gpu-blocks-override", "x"], 1, "invalid int value: 'x'"),
        (["--num-gpu-blocks-override=many"], 0, "invalid int value: 'many'"),
        (["--cache-salt-policy", "sometimes"], 0, "invalid choice: 'sometimes'"),
        (["--enable-chunked-prefill", "stray"], 1, "the positional MODEL 'stray' differs from --model"),
        (["--cpu-threads", "0"], 0, "--cpu-threads=0"),
    ],
)
def test_extra_args_the_server_refuses_are_named(extra, at, said):
    with pytest.raises(SpecError) as info:
        render(body(extraArgs=extra), CONFIG)
    message = str(info.value)
    assert message.startswith(f"spec.extraArgs[{at}]={extra[at]!r} is refused by pagedllm serve: "), message
    assert said in message


def test_valid_extra_args_pass_the_parser():
    manifests = render(body(extraArgs=["--enable-chunked-prefill", "--num-gpu-blocks-override", "64"]), CONFIG)
    assert manifests.deployment["spec"]["template"]["spec"]["containers"][0]["args"][-3:] == [
        "--enable-chunked-prefill",
        "--num-gpu-blocks-override",
        "64",
    ]


def test_the_parser_the_operator_uses_imports_no_torch():
    import subprocess
    import sys

    code = (
        "import sys; from pagedllm.operator.serve_check import check_serve_args; "
        "check_serve_args(['--model', '/m'], ()); "
        "assert 'torch' not in sys.modules and 'fastapi' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_lora_flags_render_from_the_spec():
    assert "--enable-lora" not in server_args(PagedLLMSpec.from_dict({"model": "m"}), "/m")
    on = server_args(PagedLLMSpec.from_dict({"model": "m", "enableLora": True, "maxLoras": 3}), "/m")
    namespace = run_as_container(on)
    assert namespace.enable_lora is True and namespace.max_loras == 3
    with pytest.raises(SpecError, match="spec.enableLora=False is not allowed with spec.adapters"):
        PagedLLMSpec.from_dict({"model": "org/m", "enableLora": False, "adapters": [{"name": "a", "source": "o/a"}]})
