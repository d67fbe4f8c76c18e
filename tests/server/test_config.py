"""Engine configuration: the per-iteration token budget each device gets, and the KV events flag."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.server.args import add_engine_args, engine_config_from_args
from pagedllm.server.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    KVEventsConfig,
    SchedulerConfig,
    SpeculativeConfig,
    choose_token_budget,
)


def test_cpu_default_is_4096_with_256_prompt_tokens_while_decoding_and_bursts_split_over_512():
    budget = choose_token_budget(SchedulerConfig(), "cpu", max_model_len=4096)
    assert (budget.tokens, budget.reason, budget.prefill_while_decoding) == (4096, "the cpu default", 256)
    assert budget.burst_split == 512


def test_cuda_default_is_2048_without_a_bound_while_decoding_nor_burst_split():
    budget = choose_token_budget(SchedulerConfig(), "cuda", max_model_len=4096)
    assert (budget.tokens, budget.reason, budget.prefill_while_decoding) == (2048, "the cuda default", None)
    assert budget.burst_split == 0


def test_burst_split_is_off_with_async_scheduling_and_refused_when_asked_for_with_it():
    assert choose_token_budget(SchedulerConfig(async_scheduling=True), "cpu", 4096).burst_split == 0
    config = SchedulerConfig(prompt_burst_split_tokens=64)
    assert config.with_token_budget(choose_token_budget(config, "cpu", 4096)).prompt_burst_split_tokens == 64
    with pytest.raises(ConfigError) as info:
        SchedulerConfig(async_scheduling=True, prompt_burst_split_tokens=64)
    assert (info.value.field, info.value.value) == ("prompt_burst_split_tokens", 64)


def test_the_bound_while_decoding_is_kept_when_set_and_off_without_chunked_prefill():
    config = SchedulerConfig(max_num_batched_tokens=100, max_prefill_tokens_while_decoding=7)
    resolved = config.with_token_budget(choose_token_budget(config, "cuda", 4096))
    assert (resolved.token_budget, resolved.max_prefill_tokens_while_decoding) == (100, 7)
    unchunked = SchedulerConfig(enable_chunked_prefill=False)
    assert choose_token_budget(unchunked, "cpu", 4096).prefill_while_decoding is None


def test_a_bound_while_decoding_without_chunked_prefill_is_refused():
    with pytest.raises(ConfigError) as info:
        SchedulerConfig(enable_chunked_prefill=False, max_prefill_tokens_while_decoding=64)
    assert info.value.field == "max_prefill_tokens_while_decoding" and info.value.value == 64


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("chunked", [True, False])
def test_an_explicit_value_always_wins(device, chunked):
    config = SchedulerConfig(max_num_batched_tokens=100, enable_chunked_prefill=chunked)
    budget = choose_token_budget(config, device, max_model_len=4096)
    assert (budget.tokens, budget.reason) == (100, "set by max_num_batched_tokens")


@pytest.mark.parametrize(("device", "max_model_len", "tokens"), [("cpu", 8192, 8192), ("cuda", 8192, 8192)])
def test_chunked_prefill_off_fits_the_longest_prompt(device, max_model_len, tokens):
    budget = choose_token_budget(SchedulerConfig(enable_chunked_prefill=False), device, max_model_len)
    assert budget.tokens == tokens
    assert "chunked prefill being off" in budget.reason


def test_chunked_prefill_off_keeps_the_default_above_a_short_model():
    assert choose_token_budget(SchedulerConfig(enable_chunked_prefill=False), "cpu", 128).tokens == 4096
    assert choose_token_budget(SchedulerConfig(enable_chunked_prefill=False), "cuda", 128).tokens == 2048


def test_the_default_fits_one_token_per_running_sequence():
    budget = choose_token_budget(SchedulerConfig(max_num_seqs=8192), "cpu", max_model_len=256)
    assert budget.tokens == 8192 and "max_num_seqs" in budget.reason


def test_the_device_must_be_resolved():
    with pytest.raises(ConfigError) as info:
        choose_token_budget(SchedulerConfig(), "auto", max_model_len=256)
    assert info.value.field == "device"


def test_resolved_config_carries_the_budget_and_stays_frozen():
    config = SchedulerConfig()
    with pytest.raises(RuntimeError, match="depends on the device"):
        _ = config.token_budget
    resolved = config.with_token_budget(choose_token_budget(config, "cpu", 256))
    assert resolved.token_budget == resolved.max_num_batched_tokens == 4096
    assert config.max_num_batched_tokens is None


def test_the_flag_help_names_both_defaults():
    parser = add_engine_args(argparse.ArgumentParser())
    action = next(a for a in parser._actions if a.dest == "max_num_batched_tokens")
    assert action.default is None
    assert "4096 on CPU" in action.help and "2048 on CUDA" in action.help and "(default: None)" not in action.help


# -- block size ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("device", "tokens"), [("cpu", 64), ("cuda", 16)])
def test_an_unset_block_size_is_the_devices_default(device, tokens):
    config = CacheConfig()
    with pytest.raises(RuntimeError, match="depends on the device"):
        _ = config.tokens_per_block
    resolved = config.with_block_size(device)
    assert resolved.tokens_per_block == resolved.block_size == tokens
    assert config.block_size is None


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_explicit_block_size_always_wins(device):
    assert CacheConfig(block_size=16).with_block_size(device).tokens_per_block == 16


def test_a_block_size_needs_a_resolved_device_and_a_power_of_two():
    with pytest.raises(ConfigError) as info:
        CacheConfig().with_block_size("auto")
    assert info.value.field == "device"
    for bad in (0, 24, 512):
        with pytest.raises(ConfigError, match="power of two") as info:
            CacheConfig(block_size=bad)
        assert info.value.field == "block_size"


def test_the_block_size_flag_names_both_defaults():
    parser = add_engine_args(argparse.ArgumentParser())
    action = next(a for a in parser._actions if a.dest == "block_size")
    assert action.default is None and parse_flags("--block-size", "32").cache.block_size == 32
    assert "16 on CUDA" in action.help and "64 on CPU" in action.help and "(default: None)" not in action.help


# -- --kv-events-config ----------------------------------------------------------------------------------
def parse_flags(*flags: str) -> EngineConfig:
    return engine_config_from_args(add_engine_args(argparse.ArgumentParser()).parse_args(list(flags)))


def test_kv_events_are_off_unless_asked_and_take_vllms_json():
    assert parse_flags().cache.kv_events_config is None and not parse_flags().cache.kv_events_enabled
    config = parse_flags(
        "--kv-events-config",
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",'
        ' "replay_endpoint": "tcp://*:5558", "topic": "kv@10.0.0.7@llama"}',
    ).cache
    assert config.kv_events_enabled
    assert config.kv_events_config == KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint="tcp://*:5557",
        replay_endpoint="tcp://*:5558",
        topic="kv@10.0.0.7@llama",
    )


@pytest.mark.parametrize(
    "value, enabled",
    [
        ({"enable_kv_cache_events": True}, True),  # publisher defaults to zmq, as in vLLM
        ({"enable_kv_cache_events": False}, False),
        ({"enable_kv_cache_events": True, "publisher": "null"}, False),
        ({}, False),
    ],
)
def test_events_are_sent_only_when_enabled_with_a_real_publisher(value, enabled):
    assert KVEventsConfig.parse(value).enabled is enabled
    assert EngineConfig.from_kwargs(kv_events_config=value).cache.kv_events_enabled is enabled


@pytest.mark.parametrize(
    "text, flag, words",
    [
        ("{", "--kv-events-config", "is not JSON"),
        ("[1]", "--kv-events-config", "is not an object"),
        ('{"enable_kv_cache_events": 1}', "--kv-events-config.enable_kv_cache_events", "must be of type bool"),
        ('{"hwm": true}', "--kv-events-config.hwm", "must be of type int"),
        ('{"topics": "kv@"}', "--kv-events-config.topics", "allowed are ['buffer_steps'"),
        ('{"publisher": "kafka"}', "--kv-events-config.publisher", "choose one of ['null', 'zmq']"),
        ('{"endpoint": "http://x:1"}', "--kv-events-config.endpoint", "a ZeroMQ address starting with"),
        ('{"max_queue_size": 0}', "--kv-events-config.max_queue_size", "must be >= 1"),
    ],
)
def test_a_bad_value_is_refused_under_the_flag_and_key(text, flag, words):
    with pytest.raises(ConfigError) as info:
        parse_flags("--kv-events-config", text)
    assert str(info.value).startswith(flag) and words in str(info.value)


def test_kv_events_need_prefix_caching():
    with pytest.raises(ConfigError) as info:
        parse_flags("--no-enable-prefix-caching", "--kv-events-config", '{"enable_kv_cache_events": true}')
    assert info.value.field == "kv_events_config" and "needs prefix caching" in str(info.value)
    parse_flags("--no-enable-prefix-caching", "--kv-events-config", '{"enable_kv_cache_events": false}')


# -- --speculative-config --------------------------------------------------------------------------------
def test_speculation_is_off_unless_asked_and_takes_vllms_json():
    assert parse_flags().scheduler.speculative_config is None
    config = parse_flags(
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}',
    ).scheduler.speculative_config
    assert config == SpeculativeConfig("ngram", 3, prompt_lookup_max=4, prompt_lookup_min=2)
    as_kwarg = EngineConfig.from_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert as_kwarg.scheduler.speculative_config == SpeculativeConfig(num_speculative_tokens=3)


@pytest.mark.parametrize(
    "given, low, high",
    [
        ({}, 5, 5),
        ({"prompt_lookup_max": 3}, 3, 3),
        ({"prompt_lookup_min": 2}, 2, 2),
        ({"prompt_lookup_min": 1, "prompt_lookup_max": 4}, 1, 4),
    ],
)
def test_an_unset_lookup_bound_follows_the_other_as_in_vllm(given, low, high):
    config = SpeculativeConfig.parse({"method": "ngram", **given})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (low, high)


@pytest.mark.parametrize(
    "text, flag, words",
    [
        ("{", "--speculative-config", "is not JSON"),
        ('"ngram"', "--speculative-config", "is not an object"),
        (
            '{"method": "eagle"}',
            "--speculative-config.method='eagle' is not allowed",
            "choose one of ['ngram', 'draft_model']",
        ),
        ('{"num_speculative_tokens": 0}', "--speculative-config.num_speculative_tokens=0", "must be >= 1 and <= 16"),
        ('{"num_speculative_tokens": "4"}', "--speculative-config.num_speculative_tokens", "must be of type int"),
        (
            '{"prompt_lookup_min": 4, "prompt_lookup_max": 2}',
            "--speculative-config.prompt_lookup_max=2",
            "must be >= 4",
        ),
        ('{"prompt_lookup_min": 0}', "--speculative-config.prompt_lookup_min=0", "must be >= 1"),
        ('{"k": 4}', "--speculative-config.k", "allowed are ['method', 'model', 'num_speculative_tokens'"),
    ],
)
def test_a_bad_speculative_value_is_refused_under_the_flag_and_key(text, flag, words):
    with pytest.raises(ConfigError) as info:
        parse_flags("--speculative-config", text)
    assert str(info.value).startswith(flag) and words in str(info.value)
