"""A tensor-parallel rank's end of the control channel (see :mod:`.channel_protocol`)."""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from typing import Any

from pagedllm.server.worker.channel_protocol import (
    HEARTBEAT_S,
    FrameReader,
    RankLostError,
    heartbeat_timeout,
    rank_frame,
    recv_one,
    tune,
)

logger = logging.getLogger("pagedllm.tp")


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
        self._reader = FrameReader()
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
        tune(sock)
        sock.settimeout(None)
        channel = cls(sock, f"{host}:{port}")
        channel.send(hello)
        return channel

    def first(self, timeout: float) -> Any:
        """The leader's first message (its welcome or a refusal), before the reader thread runs."""
        return recv_one(self.sock, self._reader, time.monotonic() + timeout)

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
