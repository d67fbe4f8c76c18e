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
"""

from __future__ import annotations

import collections
import json
import logging
import os
import pickle
import queue
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("pagedllm.tp")
HEADER = struct.Struct("!Q")
HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_ENV = "PAGEDLLM_TP_HEARTBEAT_TIMEOUT"
JOIN_TIMEOUT_ENV = "PAGEDLLM_TP_JOIN_TIMEOUT"


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


def _from_rank(payload: bytes) -> Any:
    return json.loads(payload)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # NOTE: a step is one small write: no Nagle delay
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class _Reader:
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


def _recv_one(sock: socket.socket, reader: _Reader, deadline: float) -> Any:
    """One whole message from a blocking socket, within ``deadline`` (monotonic)."""
    while not reader.pending:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        data = sock.recv(1 << 16)
        if not data:
            raise RankLostError("the connection closed")
        reader.feed(data)
    return reader.pending.popleft()


@dataclass
class Peer:
    """One connected rank, as the leader sees it."""

    rank: int
    node: int
    pid: int
    host: str
    sock: socket.socket
    reader: _Reader = field(default_factory=lambda: _Reader(_from_rank))
    replies: queue.Queue = field(default_factory=queue.Queue)
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_seen: float = field(default_factory=time.monotonic)
    busy: bool = False
    """What the rank's last heartbeat said: inside a step."""

    def name(self) -> str:
        return f"tensor-parallel rank {self.rank} on node {self.node} (pid {self.pid} on {self.host})"


class LeaderChannel:
    """The engine's end: accepts every rank, broadcasts messages, collects replies, watches for silence."""

    def __init__(self, host: str, port: int, nodes_of: dict[int, int]) -> None:
        self.nodes_of = nodes_of
        """Node of each rank that must join (every rank but 0)."""
        self.listener = socket.create_server((host, port), reuse_port=False)
        self.port = self.listener.getsockname()[1]
        self.peers: dict[int, Peer] = {}
        self.error: str | None = None
        self.lost_rank: int | None = None
        self.timeout = heartbeat_timeout()
        self._closed = threading.Event()
        self._pump: threading.Thread | None = None
        self.on_tick: Any = None
        """Called by the pump thread about twice a second (the engine's hang watchdog)."""

    # -- start-up ----------------------------------------------------------------------------
    def accept_all(self, timeout: float, hello_check: Any, alive: Any = None) -> None:
        """Wait until every rank said hello; name the nodes still missing when ``timeout`` passes.

        ``hello_check(hello) -> str | None`` refuses a rank started with another layout;
        ``alive() -> None`` raises if a local rank process died meanwhile.
        """
        deadline = time.monotonic() + timeout
        self.listener.settimeout(0.2)
        while len(self.peers) < len(self.nodes_of):
            if alive is not None:
                alive()
            if time.monotonic() > deadline:
                raise RankLostError(self._missing(timeout))
            try:
                sock, address = self.listener.accept()
            except TimeoutError:
                continue
            self._greet(sock, address, deadline, hello_check)

    def _greet(self, sock: socket.socket, address: Any, deadline: float, hello_check: Any) -> None:
        _tune(sock)
        try:
            hello = _recv_one(sock, _Reader(_from_rank), min(deadline, time.monotonic() + 30))
            _, rank, node, pid, host, layout = hello
        except (OSError, RankLostError, ValueError, TypeError) as exc:
            logger.warning("a connection from %s sent no hello (%r): closed", address, exc)
            sock.close()
            return
        problem = hello_check(layout)
        if problem is None and (self.nodes_of.get(rank) != node or rank in self.peers):
            problem = f"rank {rank} on node {node} is not expected (or joined twice)"
        if problem is not None:
            with sock:
                sock.sendall(frame(("refused", problem)))
            raise RankLostError(f"node {node} (rank {rank}, {host}) was refused: {problem}")
        sock.settimeout(None)  # NOTE: blocking; the pump reads a socket only once select says it is readable
        self.peers[rank] = Peer(rank, node, pid, host, sock)
        logger.info("tensor-parallel rank %d on node %d (%s) joined", rank, node, host)

    def _missing(self, timeout: float) -> str:
        missing: dict[int, list[int]] = {}
        for rank, node in sorted(self.nodes_of.items()):
            if rank not in self.peers:
                missing.setdefault(node, []).append(rank)
        parts = [f"node {node} (ranks {', '.join(map(str, ranks))})" for node, ranks in sorted(missing.items())]
        return (
            f"{'; '.join(parts)} did not join within {timeout:.0f}s: start `pagedllm serve --headless"
            f" --node-rank N` there, pointed at this node's --master-addr and --master-port {self.port}"
        )

    def start(self) -> None:
        """Start the pump thread (after start-up: from now on silence and closed connections count)."""
        now = time.monotonic()
        for peer in self.peers.values():
            peer.last_seen = now
        self._pump = threading.Thread(target=self._run, name="pagedllm-tp-channel", daemon=True)
        self._pump.start()

    # -- messages ----------------------------------------------------------------------------
    def broadcast(self, message: Any) -> None:
        """The same message to every rank, pickled once."""
        data = frame(message)
        for peer in self.peers.values():
            self._send(peer, data)

    def _send(self, peer: Peer, data: bytes) -> None:
        try:
            with peer.lock:
                peer.sock.sendall(data)
        except OSError as exc:
            self._lost(peer, f"stopped listening ({exc.strerror or exc!r})")

    def reply(self, rank: int, timeout: float) -> Any:
        """The next reply from ``rank``; :class:`RankLostError` if it is gone or silent past ``timeout``."""
        peer = self.peers[rank]
        deadline = time.monotonic() + timeout
        while True:
            try:
                return peer.replies.get(timeout=0.1)
            except queue.Empty:
                pass
            if self.error is not None:
                raise RankLostError(self.error)
            if time.monotonic() > deadline:
                raise RankLostError(f"{peer.name()} did not answer within {timeout:.0f}s")

    # -- the pump thread ---------------------------------------------------------------------
    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        for peer in self.peers.values():
            selector.register(peer.sock, selectors.EVENT_READ, peer)
        next_beat = 0.0
        while not self._closed.is_set():
            for key, _ in selector.select(timeout=HEARTBEAT_S / 2):
                self._read(key.data, selector)
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + HEARTBEAT_S
                self.broadcast(("heartbeat",))
                self._check_silence(now)
            if self.on_tick is not None:
                self.on_tick()
        selector.close()

    def _read(self, peer: Peer, selector: selectors.BaseSelector) -> None:
        try:
            data = peer.sock.recv(1 << 16)
        except OSError as exc:
            data = b""
            logger.debug("reading from rank %d failed: %r", peer.rank, exc)
        if not data:
            selector.unregister(peer.sock)
            self._lost(peer, "closed its connection: the process exited or its host went away")
            return
        peer.last_seen = time.monotonic()
        peer.reader.feed(data)
        for message in peer.reader.take():
            if message[0] == "heartbeat":
                peer.busy = message[1]
            else:
                peer.replies.put(message)

    def _check_silence(self, now: float) -> None:
        for peer in self.peers.values():
            if now - peer.last_seen > self.timeout:
                self._lost(peer, f"sent nothing for {now - peer.last_seen:.0f}s (its host may be gone)")

    def _lost(self, peer: Peer, what: str) -> None:
        if self.error is None and not self._closed.is_set():
            self.lost_rank = peer.rank
            self.error = f"{peer.name()} {what}"
            logger.error("%s", self.error)

    def busy_ranks(self) -> list[Peer]:
        """Ranks whose last heartbeat said they were inside a step."""
        return [peer for peer in self.peers.values() if peer.busy]

    def close(self, farewell: Any = None) -> None:
        """Say ``farewell`` to every rank (if given), stop the pump and close every socket."""
        if farewell is not None and not self._closed.is_set():
            data = frame(farewell)
            for peer in self.peers.values():
                try:
                    with peer.lock:
                        peer.sock.settimeout(5)
                        peer.sock.sendall(data)
                except OSError:
                    pass
        self._closed.set()
        if self._pump is not None and self._pump is not threading.current_thread():
            self._pump.join(timeout=5)
        for peer in self.peers.values():
            peer.sock.close()
        self.listener.close()


class RankChannel:
    """A rank's end: connects to the leader, hands its messages to the rank's loop, heartbeats.

    NOTE: when the leader closes the connection without saying goodbye, or goes quiet past the
    heartbeat timeout, the reader thread ends the whole process (exit code 1) at once: the rank's
    main thread may be blocked in a collective that would otherwise wait for minutes.
    """

    def __init__(self, sock: socket.socket, leader: str) -> None:
        self.sock = sock
        self.leader = leader
        self.inbox: queue.Queue = queue.Queue()
        self.busy = False
        self.timeout = heartbeat_timeout()
        self._lock = threading.Lock()
        self._reader = _Reader()
        self._done = threading.Event()

    @classmethod
    def connect(cls, host: str, port: int, hello: tuple, timeout: float) -> RankChannel:
        """Connect to the leader (retrying until ``timeout``) and say hello."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=5)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise RankLostError(
                        f"the leader at {host}:{port} did not accept within {timeout:.0f}s: {exc}"
                    ) from exc
                time.sleep(0.5)
        _tune(sock)
        sock.settimeout(None)
        channel = cls(sock, f"{host}:{port}")
        channel.send(hello)
        return channel

    def first(self, timeout: float) -> Any:
        """The leader's first message (its welcome or a refusal), before the reader thread runs."""
        return _recv_one(self.sock, self._reader, time.monotonic() + timeout)

    def start(self) -> None:
        self.sock.settimeout(HEARTBEAT_S)
        threading.Thread(target=self._run, name="pagedllm-tp-channel", daemon=True).start()

    def send(self, message: Any) -> None:
        data = rank_frame(message)
        with self._lock:
            self.sock.sendall(data)

    def recv(self) -> Any:
        return self.inbox.get()

    def _run(self) -> None:
        last_seen = time.monotonic()
        for message in self._reader.take():
            self._handle(message)
        while not self._done.is_set():
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                data = None
            except OSError:
                data = b""
            now = time.monotonic()
            if data == b"":
                self._leader_gone("closed the connection: the engine exited or its host went away")
            if data:
                last_seen = now
                self._reader.feed(data)
                for message in self._reader.take():
                    self._handle(message)
            elif now - last_seen > self.timeout:
                self._leader_gone(f"sent nothing for {now - last_seen:.0f}s")
            self._heartbeat()

    def _handle(self, message: Any) -> None:
        kind = message[0]
        if kind == "heartbeat":
            return
        if kind == "abort":
            self._exit(f"the leader at {self.leader} stopped this rank: {message[1]}")
        if kind == "shutdown":
            self._done.set()
        self.inbox.put(message)

    def _heartbeat(self) -> None:
        try:
            self.send(("heartbeat", self.busy))
        except OSError:
            self._leader_gone("stopped listening")

    def _leader_gone(self, what: str) -> None:
        self._exit(f"the leader at {self.leader} {what}: this rank exits")

    def _exit(self, why: str) -> None:
        if self._done.is_set():
            return
        logger.error("%s", why)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)

    def close(self) -> None:
        self._done.set()
        self.sock.close()
