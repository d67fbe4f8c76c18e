"""Puts the prefix cache's events on the wire as vLLM does, for llm-d's precise prefix-cache scorer.

One message per engine step that had events, on a ZeroMQ PUB socket, in three frames::

    [topic, sequence number (8 bytes, big-endian), payload]

    payload = msgpack of KVEventBatch, an array:  [ts, [event, ...], data_parallel_rank]
    event   = a tagged array (msgspec's array_like + tag, vLLM's layout):
              ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
              ["BlockRemoved", block_hashes, medium]
              ["AllBlocksCleared"]

Hashes are unsigned 64-bit ints (see :mod:`pagedllm.server.core.kv_events`); ``medium`` is
``"GPU"``, the device cache tier, as vLLM names it; ``lora_id`` / ``lora_name`` are None.

With a ``replay_endpoint`` a ROUTER socket serves recent batches again: a client sends
``[b"", start sequence (8 bytes, big-endian)]`` and gets ``[b"", topic, seq, payload]`` for
every kept batch from there on, then ``[b"", b"", -1 (8 bytes, signed), b""]``.

NOTE: :meth:`ZmqEventPublisher.publish` never blocks the engine step: batches wait in a
bounded queue for a background thread that encodes and sends them; when the queue is full
the oldest batch is dropped and counted. Sequence numbers are given at publish time, so a
dropped batch leaves a gap a subscriber can see.

pyzmq and msgspec are imported here only, and this module only when events are enabled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import msgspec
import zmq

from pagedllm.server.config import ConfigError, KVEventsConfig
from pagedllm.server.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

logger = logging.getLogger("pagedllm.kv_events")

MEDIUM_GPU = "GPU"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
REPLAY_POLL_S = 0.05
"""How often the thread looks for replay requests while no batch comes."""
CLOSE_TIMEOUT_S = 2.0


# -- the wire format (vLLM's msgspec structs, by layout and tag) ---------------------------------------------
class WireEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class WireBlockStored(WireEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class WireBlockRemoved(WireEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class WireAllBlocksCleared(WireEvent, tag="AllBlocksCleared"):
    pass


WireKVEvent = WireBlockStored | WireBlockRemoved | WireAllBlocksCleared


class WireEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[WireKVEvent]
    data_parallel_rank: int | None = None


def to_wire(event: KVCacheEvent) -> WireKVEvent:
    if isinstance(event, BlockStored):
        return WireBlockStored(
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            None,
            MEDIUM_GPU,
            None,
        )
    if isinstance(event, BlockRemoved):
        return WireBlockRemoved(list(event.block_hashes), MEDIUM_GPU)
    assert isinstance(event, AllBlocksCleared), event
    return WireAllBlocksCleared()


def encode_batch(encoder: msgspec.msgpack.Encoder, ts: float, events: list[KVCacheEvent]) -> bytes:
    """The payload frame of one step's events."""
    return encoder.encode(WireEventBatch(ts, [to_wire(e) for e in events], data_parallel_rank=0))


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: wildcard, IPv6-any, ipc and inproc addresses are bound; others are connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _attach(socket: zmq.Socket, key: str, endpoint: str, bind: bool) -> None:
    """Bind or connect ``socket``; a refusal (say, a port in use) names the config key and the address."""
    try:
        socket.bind(endpoint) if bind else socket.connect(endpoint)
    except zmq.ZMQError as exc:
        action = "bound" if bind else "connected to"
        raise ConfigError(
            f"kv_events_config.{key}", endpoint, f"{exc.strerror}", problem=f"could not be {action}"
        ) from exc


# -- the publisher -----------------------------------------------------------------------------------------
class ZmqEventPublisher:
    """Sends event batches from a background thread; ``publish`` only queues them."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self.num_published = 0
        """Batches sent on the PUB socket."""
        self.num_dropped = 0
        """Batches dropped because the queue was full (the oldest go first)."""
        self._topic = config.topic.encode()
        self._pending: deque[tuple[int, float, list[KVCacheEvent]]] = deque(maxlen=config.max_queue_size)
        self._replay_buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._wake = threading.Condition()
        self._next_seq = 0
        self._closing = False
        # NOTE: the sockets are made (and bound) here, so a taken port fails start-up;
        # from then on only the thread uses them (ZeroMQ sockets are not thread-safe).
        self._ctx = zmq.Context()
        try:
            self._pub = self._open_pub(config.endpoint)
            self._replay = self._open_replay(config.replay_endpoint)
        except BaseException:
            self._ctx.destroy(linger=0)  # NOTE: closes a socket opened before the failure too
            raise
        self._thread = threading.Thread(target=self._run, name="pagedllm-kv-events", daemon=True)
        self._thread.start()

    def _open_pub(self, endpoint: str) -> zmq.Socket:
        pub = self._ctx.socket(zmq.PUB)
        pub.set_hwm(self.config.hwm)
        _attach(pub, "endpoint", endpoint, bind=is_bind_endpoint(endpoint))
        return pub

    def _open_replay(self, endpoint: str | None) -> zmq.Socket | None:
        if endpoint is None:
            return None
        replay = self._ctx.socket(zmq.ROUTER)
        _attach(replay, "replay_endpoint", endpoint, bind=True)
        return replay

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events (never blocks on the network)."""
        with self._wake:
            if self._closing:
                return
            if len(self._pending) == self._pending.maxlen:
                self.num_dropped += 1
                if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                    logger.warning("KV event queue full: %d batch(es) dropped so far", self.num_dropped)
            self._pending.append((self._next_seq, time.time(), events))
            self._next_seq += 1
            self._wake.notify()

    def close(self) -> None:
        """Send what is queued (for up to a few seconds), then close the sockets. Idempotent."""
        with self._wake:
            if self._closing:
                return
            self._closing = True
            self._wake.notify()
        self._thread.join(CLOSE_TIMEOUT_S)
        self._ctx.destroy(linger=0)

    # -- the thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            batch = self._next_batch()
            if self._replay is not None:
                self._serve_replay()
            if batch is not None:
                self._send(encoder, *batch)
            elif self._closing:
                return

    def _next_batch(self) -> tuple[int, float, list[KVCacheEvent]] | None:
        with self._wake:
            if not self._pending and not self._closing:
                self._wake.wait(REPLAY_POLL_S if self._replay is not None else None)
            return self._pending.popleft() if self._pending else None

    def _send(self, encoder: msgspec.msgpack.Encoder, seq: int, ts: float, events: list[KVCacheEvent]) -> None:
        try:
            payload = encode_batch(encoder, ts, events)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except Exception:  # noqa: BLE001 (a lost batch must not end the thread)
            logger.exception("could not publish KV event batch %d", seq)
            return
        self.num_published += 1
        if self._replay is not None:
            self._replay_buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("ignoring a malformed KV event replay request of %d frame(s)", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in self._replay_buffer:
                if seq >= start:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))
