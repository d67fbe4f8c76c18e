"""The engine's end of the tensor-parallel control channel (see :mod:`.channel_protocol`)."""

from __future__ import annotations

import logging
import queue
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.server.worker.channel_protocol import (
    HEARTBEAT_S,
    FrameReader,
    RankLostError,
    frame,
    from_rank,
    heartbeat_timeout,
    recv_one,
    tune,
)

logger = logging.getLogger("pagedllm.tp")


@dataclass
class Peer:
    """One connected rank, as the leader sees it."""

    rank: int
    node: int
    pid: int
    host: str
    sock: socket.socket
    reader: FrameReader = field(default_factory=lambda: FrameReader(from_rank))
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
        tune(sock)
        try:
            hello = recv_one(sock, FrameReader(from_rank), min(deadline, time.monotonic() + 30))
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
