"""The engine's end of the ranks' TCP channel, driven by plain sockets standing in for ranks: who may join,
who is missing, and how a rank that closes its connection or goes quiet is named."""

from __future__ import annotations

import json
import pickle
import socket
import threading
import time

import pytest

from pagedllm.server.worker.channel_protocol import HEADER, FrameReader, RankLostError, frame, rank_frame
from pagedllm.server.worker.leader_channel import LeaderChannel

LAYOUT = (4, 2)


class FakeRank:
    """A plain socket that says hello as a rank would, and reads what the leader sends."""

    def __init__(self, port: int, rank: int, node: int, layout=LAYOUT) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.reader = FrameReader()
        self.send(("hello", rank, node, 4242, "node-host", layout))

    def send(self, message) -> None:
        self.sock.sendall(rank_frame(message))

    def read(self):
        """The next message from the leader; None once it closed the connection."""
        while not self.reader.pending:
            data = self.sock.recv(1 << 16)
            if not data:
                return None
            self.reader.feed(data)
        return self.reader.pending.popleft()

    def close(self) -> None:
        self.sock.close()


def same_layout(theirs):
    return None if tuple(theirs) == LAYOUT else f"it was started with {tuple(theirs)}"


def joined(channel: LeaderChannel, *ranks: tuple[int, int]) -> list[FakeRank]:
    """Ranks (rank, node) connect while the channel accepts them; their sockets."""
    socks: list[FakeRank] = []
    thread = threading.Thread(target=lambda: socks.extend(FakeRank(channel.port, r, n) for r, n in ranks))
    thread.start()
    channel.accept_all(10, same_layout)
    thread.join()
    return socks


def test_frames_cut_anywhere_are_put_back_together():
    data = frame(("step", list(range(1000)))) + frame(("heartbeat", False))
    reader = FrameReader()
    for i in range(0, len(data), 7):
        reader.feed(data[i : i + 7])
    assert reader.take() == [("step", list(range(1000))), ("heartbeat", False)]
    assert HEADER.unpack_from(frame("x"))[0] == len(pickle.dumps("x", protocol=pickle.HIGHEST_PROTOCOL))
    from_rank = FrameReader(json.loads)
    data = rank_frame(("hello", 1, 0, 7, "h", (2, 1))) + rank_frame(("heartbeat", True))
    for i in range(0, len(data), 5):
        from_rank.feed(data[i : i + 5])
    assert from_rank.take() == [["hello", 1, 0, 7, "h", [2, 1]], ["heartbeat", True]]


def test_what_arrives_at_the_leader_is_never_unpickled():
    """A connection that sends a pickle (or any non-JSON) instead of a hello is closed and forgotten."""
    channel = LeaderChannel("127.0.0.1", 0, {1: 0})
    try:

        def hostile_then_honest() -> None:
            with socket.create_connection(("127.0.0.1", channel.port), timeout=10) as sock:
                sock.sendall(frame(("hello", 1, 0, 1, "x", LAYOUT)))  # a pickle, as an attacker would send
                sock.recv(1)  # closed by the leader
            socks.append(FakeRank(channel.port, 1, 0))

        socks: list[FakeRank] = []
        thread = threading.Thread(target=hostile_then_honest)
        thread.start()
        channel.accept_all(10, same_layout)
        thread.join()
        assert list(channel.peers) == [1] and channel.peers[1].host == "node-host"
    finally:
        channel.close()


def test_a_missing_node_is_named_with_its_ranks():
    channel = LeaderChannel("127.0.0.1", 0, {1: 0, 2: 1, 3: 1})
    try:
        socks: list[FakeRank] = []
        joiner = threading.Thread(target=lambda: socks.append(FakeRank(channel.port, 1, 0)))
        joiner.start()
        with pytest.raises(RankLostError, match=r"^node 1 \(ranks 2, 3\) did not join within 1s: start"):
            channel.accept_all(1, same_layout)
        joiner.join()
        assert list(channel.peers) == [1]
    finally:
        channel.close()


def test_a_rank_of_another_layout_is_refused_and_told_why():
    channel = LeaderChannel("127.0.0.1", 0, {1: 0, 2: 1, 3: 1})
    try:
        socks: list[FakeRank] = []
        joiner = threading.Thread(target=lambda: socks.append(FakeRank(channel.port, 2, 1, layout=(8, 2))))
        joiner.start()
        with pytest.raises(RankLostError, match=r"node 1 \(rank 2, node-host\) was refused: it was started with"):
            channel.accept_all(10, same_layout)
        joiner.join()
        assert socks[0].read() == ("refused", "it was started with (8, 2)")
    finally:
        channel.close()


def test_an_unexpected_rank_is_refused():
    channel = LeaderChannel("127.0.0.1", 0, {1: 1})
    try:
        socks: list[FakeRank] = []
        joiner = threading.Thread(target=lambda: socks.append(FakeRank(channel.port, 1, 0)))
        joiner.start()
        with pytest.raises(RankLostError, match="rank 1 on node 0 is not expected"):
            channel.accept_all(10, same_layout)
        joiner.join()
    finally:
        channel.close()


def test_a_rank_that_closes_its_connection_is_named_and_replies_fail():
    channel = LeaderChannel("127.0.0.1", 0, {1: 0, 2: 1})
    try:
        first, second = joined(channel, (1, 0), (2, 1))
        channel.start()
        channel.broadcast(("device_blocks", 10))
        assert second.read() == ("device_blocks", 10)
        second.send(("reply", 7))
        assert channel.reply(2, 10) == ["reply", 7]
        second.close()
        with pytest.raises(RankLostError, match=r"rank 2 on node 1 \(pid 4242 on node-host\) closed its connection"):
            channel.reply(1, 10)
        assert channel.lost_rank == 2
        first.close()
    finally:
        channel.close()


def test_a_rank_that_goes_quiet_is_named(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_TP_HEARTBEAT_TIMEOUT", "2")
    channel = LeaderChannel("127.0.0.1", 0, {1: 1})
    try:
        (sock,) = joined(channel, (1, 1))
        channel.start()
        started = time.monotonic()
        while channel.error is None and time.monotonic() - started < 10:
            time.sleep(0.1)
        assert channel.error is not None and "rank 1 on node 1" in channel.error and "sent nothing" in channel.error
        assert sock.read() == ("heartbeat",)  # the leader's own heartbeats went out meanwhile
        sock.close()
    finally:
        channel.close()


def test_heartbeats_keep_a_rank_alive_and_report_it_busy(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_TP_HEARTBEAT_TIMEOUT", "2")
    channel = LeaderChannel("127.0.0.1", 0, {1: 1})
    try:
        (sock,) = joined(channel, (1, 1))
        channel.start()
        for _ in range(8):
            sock.send(("heartbeat", True))
            time.sleep(0.4)
        assert channel.error is None
        assert [peer.rank for peer in channel.busy_ranks()] == [1]
        channel.close(farewell=("shutdown",))
        messages = []
        while (message := sock.read()) is not None and message != ("shutdown",):
            messages.append(message)
        assert message == ("shutdown",) and set(messages) <= {("heartbeat",)}
    finally:
        channel.close()


def test_a_refused_rank_exits_with_code_2():
    from pagedllm.server.worker.tp_rank import run_rank

    channel = LeaderChannel("127.0.0.1", 0, {1: 1})
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(run_rank("127.0.0.1", channel.port, 1, 1, (8, 2))))
    thread.start()
    try:
        with pytest.raises(RankLostError, match="was refused: it was started with"):
            channel.accept_all(10, same_layout)
        thread.join(timeout=10)
        assert codes == [2]
    finally:
        channel.close()
