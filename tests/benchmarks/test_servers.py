"""Servers launched for the serving benchmark are sized for the client's load, as a user would."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.servers import batch_flags, our_command


def _args(**kw):
    base = dict(model_dir="/m", threads=2, dtype="bfloat16", serve_args="", max_concurrency=8)
    return SimpleNamespace(**(base | kw))


def test_our_server_takes_as_many_sequences_as_the_client_sends_at_once():
    cmd = our_command(_args(), 8000)
    assert cmd[cmd.index("--max-num-seqs") + 1] == "8"
    assert "--max-num-seqs" not in our_command(_args(max_concurrency=None), 8000)


def test_flags_given_for_the_server_win():
    assert batch_flags(_args(), ["--max-num-seqs", "4"]) == []
    assert batch_flags(_args(), ["--max-num-seqs=4"]) == []
    cmd = our_command(_args(serve_args="--max-num-seqs 4"), 8000)
    assert cmd.count("--max-num-seqs") == 1 and cmd[cmd.index("--max-num-seqs") + 1] == "4"
