"""The llama.cpp comparison's commands and parsing, on canned llama.cpp output (no llama.cpp needed)."""

from __future__ import annotations

import json

import pytest

from benchmarks.llamacpp import (
    batch_rate,
    bench_command,
    completion_body,
    parse_args,
    parse_bench,
    parse_completion,
    server_command,
)

# NOTE: llama-bench -m qwen-0.5b-bf16.gguf -t 2 -p 0 -n 4 -r 1 -o json, fields trimmed
BENCH_JSON = """[
  {
    "build_commit": "unknown",
    "cpu_info": "AMD EPYC",
    "model_type": "qwen2 1B BF16",
    "model_size": 988208640,
    "n_threads": 2,
    "type_k": "f16",
    "type_v": "f16",
    "n_prompt": 0,
    "n_gen": 4,
    "n_depth": 0,
    "avg_ns": 31883965556,
    "stddev_ns": 0,
    "avg_ts": 52.125455,
    "stddev_ts": 0.500000,
    "samples_ns": [ 31883965556 ],
    "samples_ts": [ 52.125455 ]
  }
]"""

# NOTE: the fields of a llama-server /completion answer the benchmark reads (others dropped)
COMPLETION = {
    "content": " the the",
    "tokens_predicted": 128,
    "tokens_evaluated": 32,
    "stop": True,
    "timings": {
        "prompt_n": 32,
        "prompt_ms": 310.5,
        "predicted_n": 128,
        "predicted_ms": 4100.25,
        "predicted_per_second": 31.2,
    },
}


def test_bench_command_measures_generation_only_as_json():
    assert bench_command("/b/llama-bench", "m.gguf", 2, 128, 3) == [
        "/b/llama-bench", "-m", "m.gguf", "-t", "2", "-p", "0", "-n", "128", "-r", "3", "-o", "json",
    ]  # fmt: skip


def test_parse_bench_reads_the_generation_rate_and_what_ran():
    parsed = parse_bench(BENCH_JSON)
    assert parsed["tokens_per_s"] == pytest.approx(52.125455)
    assert parsed["stddev_tokens_per_s"] == pytest.approx(0.5)
    assert parsed["n_threads"] == 2 and parsed["n_gen"] == 4 and parsed["model_type"] == "qwen2 1B BF16"


def test_parse_bench_skips_prompt_tests():
    tests = json.loads(BENCH_JSON)
    prompt = dict(tests[0], n_prompt=512, n_gen=0, avg_ts=900.0)
    assert parse_bench(json.dumps([prompt, *tests]))["tokens_per_s"] == pytest.approx(52.125455)


@pytest.mark.parametrize("stdout", ["", "not json", json.dumps([{"n_prompt": 512, "n_gen": 0, "avg_ts": 1.0}])])
def test_parse_bench_rejects_output_without_a_generation_test(stdout):
    with pytest.raises(ValueError):
        parse_bench(stdout)


def test_server_command_gives_each_slot_its_context():
    command = server_command("llama-server", "m.gguf", 2, 16, 176, 8093)
    assert command[command.index("-np") + 1] == "16"
    assert command[command.index("-c") + 1] == str(16 * 176)
    assert command[command.index("-t") + 1] == "2"
    assert command[command.index("--port") + 1] == "8093" and "-cb" in command


def test_completion_body_is_greedy_with_a_fixed_length():
    body = completion_body([5, 6, 7], 128)
    expected = {"prompt": [5, 6, 7], "n_predict": 128, "ignore_eos": True, "temperature": 0.0}
    assert body == expected | {"cache_prompt": False}


def test_parse_completion_and_batch_rate():
    parsed = parse_completion(COMPLETION)
    assert parsed == {"tokens": 128, "prompt_ms": 310.5, "predicted_ms": 4100.25}
    no_count = {k: v for k, v in COMPLETION.items() if k != "tokens_predicted"}
    assert parse_completion(no_count)["tokens"] == 128
    rate = batch_rate([parsed] * 16, wall_s=8.0)
    assert rate == {"tokens_per_s": 256.0, "tokens": 2048, "wall_s": 8.0}


def test_parse_completion_rejects_an_answer_without_a_count():
    with pytest.raises(ValueError):
        parse_completion({"content": "x"})


def test_parse_args_validates_at_the_edge(capsys):
    args = parse_args(["--model", "m", "--gguf", "g.gguf", "--batch-sizes", "1,16"])
    assert args.batch_sizes == [1, 16] and args.n_gen == 128
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--gguf", "g.gguf", "--n-gen", "0"])
    assert "--n-gen=0" in capsys.readouterr().err
