"""`pagedllm serve` flags: documented, mapped onto the engine config, and refused at start-up when invalid."""

from __future__ import annotations

import pytest

from pagedllm.server.args import engine_config_from_args
from pagedllm.server.config import EngineConfig
from pagedllm.server.entrypoints import serve
from pagedllm.server.entrypoints.cli import build_parser, main

ISSUE_FLAGS = (
    "--model",
    "--host",
    "--port",
    "--block-size",
    "--tensor-parallel-size",
    "--gpu-memory-utilization",
    "--swap-space",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--max-model-len",
    "--dtype",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--preemption-mode",
    "--num-gpu-blocks-override",
    "--seed",
    "--served-model-name",
    "--api-key",
    "--max-queue-len",
    "--max-waiting-requests",
    "--request-timeout",
    "--max-request-body-bytes",
    "--cache-salt-policy",
    "--cpu-threads",
    "--drain-timeout",
    "--chat-template",
    "--load-format",
    "--log-level",
)


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ISSUE_FLAGS:
        assert flag in text, flag


def test_flags_map_onto_the_same_fields_as_llm_kwargs():
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            "/m",
            "--block-size",
            "32",
            "--max-num-seqs",
            "7",
            "--no-enable-prefix-caching",
            "--preemption-mode",
            "swap",
            "--swap-space",
            "2",
            "--max-model-len",
            "300",
            "--dtype",
            "float16",
            "--num-gpu-blocks-override",
            "99",
            "--seed",
            "5",
            "--load-format",
            "dummy",
            "--gpu-memory-utilization",
            "0.5",
            "--max-num-batched-tokens",
            "512",
            "--tensor-parallel-size",
            "1",
        ]
    )
    expected = EngineConfig.from_kwargs(
        model="/m",
        block_size=32,
        max_num_seqs=7,
        enable_prefix_caching=False,
        preemption_mode="swap",
        swap_space=2.0,
        max_model_len=300,
        dtype="float16",
        num_gpu_blocks_override=99,
        seed=5,
        load_format="dummy",
        gpu_memory_utilization=0.5,
        max_num_batched_tokens=512,
        tensor_parallel_size=1,
    )
    assert engine_config_from_args(args) == expected


def test_server_settings_from_flags_and_environment(monkeypatch, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    args = build_parser().parse_args(
        [
            "serve",
            "--served-model-name",
            "a",
            "b",
            "--max-queue-len",
            "3",
            "--drain-timeout",
            "7.5",
            "--chat-template",
            str(template),
        ]
    )
    monkeypatch.setenv(serve.API_KEY_ENV, "from-env")
    settings = serve.settings_from_args(args)
    assert settings.served_model_names == ["a", "b"] and settings.max_queue_len == 3
    assert settings.drain_timeout == 7.5 and settings.api_key == "from-env"
    assert settings.chat_template == template.read_text()
    args = build_parser().parse_args(["serve", "--api-key", "from-flag", "--chat-template", "{{ messages }}"])
    settings = serve.settings_from_args(args)
    assert settings.api_key == "from-flag" and settings.chat_template == "{{ messages }}"


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--block-size", "3"], "--block-size=3"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization=1.5"),
        (["--max-num-seqs", "0"], "--max-num-seqs=0"),
        (["--max-queue-len", "0"], "--max-waiting-requests=0"),
        (["--request-timeout", "0"], "--request-timeout=0"),
        (["--cpu-threads", "0"], "--cpu-threads=0"),
        (["--drain-timeout", "-1"], "--drain-timeout=-1"),
        (["--port", "70000"], "--port=70000"),
        (["--api-key", ""], "--api-key=''"),
        (["--model", "/does/not/exist"], "--model='/does/not/exist'"),
        (["--chat-template", "no-such-file.jinja"], "--chat-template='no-such-file.jinja'"),
        (["--dtype", "float8"], "--dtype"),
        (["--log-level", "loud"], "--log-level"),
        (["--port", "eighty"], "--port"),
    ],
)
def test_invalid_flags_fail_at_start_up_naming_flag_and_value(capsys, argv, expected):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_operator_without_kopf_says_what_is_missing(monkeypatch, capsys):
    import sys

    monkeypatch.delitem(sys.modules, "pagedllm.operator.main", raising=False)
    monkeypatch.setitem(sys.modules, "kopf", None)  # NOTE: None in sys.modules makes `import kopf` fail
    assert main(["operator"]) == 2
    err = capsys.readouterr().err
    assert "kopf is not installed" in err and "pagedllm[operator]" in err


def test_the_model_may_be_given_as_vllm_serve_takes_it():
    """``pagedllm serve MODEL`` is ``--model MODEL``; both at once must name the same model."""
    assert engine_config_from_args(build_parser().parse_args(["serve", "/models/m"])).model.model == "/models/m"
    both = build_parser().parse_args(["serve", "/models/m", "--model", "/models/m", "--port", "9000"])
    assert engine_config_from_args(both).model.model == "/models/m" and both.port == 9000
    assert engine_config_from_args(build_parser().parse_args(["serve"])).model.model is None  # the demo model
    with pytest.raises(ValueError, match=r"^the positional MODEL '/models/m' differs from --model '/models/other'"):
        engine_config_from_args(build_parser().parse_args(["serve", "/models/m", "--model", "/models/other"]))


def test_config_errors_name_the_flag_not_the_field():
    with pytest.raises(ValueError, match=r"^--block-size=12 is not allowed"):
        engine_config_from_args(build_parser().parse_args(["serve", "--block-size", "12"]))
    with pytest.raises(ValueError, match=r"^--max-waiting-requests=0 is out of range"):
        serve.settings_from_args(build_parser().parse_args(["serve", "--max-queue-len", "0"]))


def test_a_start_up_refusal_is_left_in_the_termination_log(tmp_path, monkeypatch, tiny_llama):
    log = tmp_path / "termination-log"
    monkeypatch.setenv("PAGEDLLM_TERMINATION_LOG", str(log))
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", tiny_llama, "--tensor-parallel-size", "3", "--port", "0"])
    assert exit_info.value.code == 2
    assert "tensor_parallel_size=3" in log.read_text() or "--tensor-parallel-size=3" in log.read_text()
