"""The tensor-parallel probe's step-message part: both transports deliver and are timed."""

from __future__ import annotations

from benchmarks.tp import message_cost


def test_step_messages_reach_ranks_over_tcp_and_pipes():
    result = message_cost(batch=4, context=64, block_size=16, repeats=5, ranks=1)
    assert result["bytes"] > 0 and result["ranks"] == 1
    for transport in ("pipe", "tcp"):
        timed = result[transport]
        assert 0 < timed["send_us"] <= timed["round_trip_us"]
        assert 0 < timed["one_way_us"] <= timed["round_trip_us"]
    assert result["tcp"]["driver_threads"] == result["pipe"]["driver_threads"] + 1  # the channel's pump
    assert result["tcp_over_pipe_one_way"] > 0
