"""The messages between the API server process and the engine-core process.

Each message is two ZMQ frames: a one-byte tag and its body. The hot ones (a step's
outputs, aborts) are msgspec structs in msgpack; the rare ones that carry arbitrary
Python objects (a request's prompt and parameters, a call on the engine, its result, an
exception, the model's description) are pickled.

::

    API server ──► engine core              engine core ──► API server
    ADD      pickle (call id, request)      READY    pickle (model info, stats)
    ABORT    msgpack [request id, ...]      REPLY    pickle (call id, ok, value or exception)
    CALL     pickle (call id, fn)           OUTPUTS  msgpack StepOutputs
    SHUTDOWN -                              ABORTED  msgpack [request id, ...]
                                            STATS    pickle EngineStats
                                            DEAD     pickle exception (start-up failure or fatal error)
"""

from __future__ import annotations

import pickle
from typing import Any

import msgspec

from pagedllm.server.engine.output_deltas import RequestDelta

ADD, ABORT, CALL, SHUTDOWN = b"A", b"X", b"C", b"S"
READY, REPLY, OUTPUTS, ABORTED, STATS, DEAD = b"R", b"P", b"O", b"Q", b"T", b"D"


class StepOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """One engine step's outputs: generation deltas, and whole embedding outputs (pickled)."""

    start: float
    """When the step started and ended (``time.monotonic``, the same clock in both processes)."""
    end: float
    deltas: list[RequestDelta]
    others: bytes | None = None
    """Pickled ``list[EmbeddingRequestOutput]``; None when the step finished no embedding."""


_outputs_encoder = msgspec.msgpack.Encoder()
_outputs_decoder = msgspec.msgpack.Decoder(StepOutputs)
_ids_decoder = msgspec.msgpack.Decoder(list[str])


def encode(value: Any) -> bytes:
    """The body of a msgpack message (step outputs, request id lists)."""
    return _outputs_encoder.encode(value)


def decode_outputs(body: bytes) -> StepOutputs:
    return _outputs_decoder.decode(body)


def decode_ids(body: bytes) -> list[str]:
    return _ids_decoder.decode(body)


def dumps(value: Any) -> bytes:
    """The body of a pickled message."""
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def loads(body: bytes) -> Any:
    return pickle.loads(body)


def portable_error(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a :class:`RuntimeError` with its repr (same message)."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 (any unpicklable exception is replaced)
        return RuntimeError(repr(exc))
    return exc
