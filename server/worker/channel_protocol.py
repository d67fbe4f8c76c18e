"""The control channel between the engine (rank 0) and the other tensor-parallel ranks, over TCP.

::

    node 0: engine (rank 0)                          node n: rank r
    ───────────────────────                          ──────────────
    LeaderChannel  listens on --master-port  ◄─────  RankChannel connects, says hello (rank, node)
                   one pump thread:                   one reader thread:
                   reads every rank's frames,           queues what the leader sends,
                   heartbeats each second,              heartbeats each second,
                   notes a rank that went quiet         exits the process when the leader
                   or closed its connection             goes quiet or closes its connection

Frames are an 8-byte length and a payload: from the leader a pickle (a step holds numpy
arrays; the leader pickles it once and writes it to every rank, a step being the same for
all), from a rank JSON (its hello, replies and heartbeats are plain values). Only control goes here: the model's
collectives (all-reduce, gather) go through torch.distributed (gloo on CPU, NCCL on GPU).

NOTE: the leader listens on the network but never unpickles what arrives: anything that
connects can at worst be refused. A rank unpickles only what comes from the leader it
connected to (--master-addr): the port is for the ranks of one server, on the pod network
of one group, never one exposed to clients.

This module holds what both ends agree on: frames, heartbeats, timeouts. The leader's end
is :mod:`pagedllm.server.worker.leader_channel`, a rank's :mod:`pagedllm.server.worker.rank_channel`.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import socket
import struct
import time
from typing import Any

HEADER = struct.Struct("!Q")
HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_ENV = "PAGEDLLM_TP_HEARTBEAT_TIMEOUT"
JOIN_TIMEOUT_ENV = "PAGEDLLM_TP_JOIN_TIMEOUT"


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank exited or hung: the model can no longer run (fatal for the engine)."""


class RankLostError(RuntimeError):
    """A rank (or, seen from a rank, the leader) closed its connection, went quiet, or never joined."""


def heartbeat_timeout() -> float:
    """Seconds of silence after which a peer counts as gone (``PAGEDLLM_TP_HEARTBEAT_TIMEOUT``, default 30)."""
    return float(os.environ.get(HEARTBEAT_TIMEOUT_ENV, "30"))


def join_timeout() -> float:
    """Seconds start-up waits for every node (``PAGEDLLM_TP_JOIN_TIMEOUT``, default 600)."""
    return float(os.environ.get(JOIN_TIMEOUT_ENV, "600"))


def frame(message: Any) -> bytes:
    """A leader's message (pickled)."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(payload)) + payload


def rank_frame(message: Any) -> bytes:
    """A rank's message (JSON: tuples arrive as lists)."""
    payload = json.dumps(message).encode()
    return HEADER.pack(len(payload)) + payload


def from_rank(payload: bytes) -> Any:
    return json.loads(payload)


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # NOTE: a step is one small write: no Nagle delay
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class FrameReader:
    """Cuts frames out of a byte stream as it arrives; whole messages wait in :attr:`pending`."""

    def __init__(self, decode: Any = pickle.loads) -> None:
        self.decode = decode
        self.buffer = bytearray()
        self.pending: collections.deque[Any] = collections.deque()

    def feed(self, data: bytes) -> None:
        self.buffer += data
        while len(self.buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(self.buffer)
            if len(self.buffer) < HEADER.size + size:
                break
            self.pending.append(self.decode(bytes(self.buffer[HEADER.size : HEADER.size + size])))
            del self.buffer[: HEADER.size + size]

    def take(self) -> list[Any]:
        messages = list(self.pending)
        self.pending.clear()
        return messages


def recv_one(sock: socket.socket, reader: FrameReader, deadline: float) -> Any:
    """One whole message from a blocking socket, within ``deadline`` (monotonic)."""
    while not reader.pending:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        data = sock.recv(1 << 16)
        if not data:
            raise RankLostError("the connection closed")
        reader.feed(data)
    return reader.pending.popleft()
