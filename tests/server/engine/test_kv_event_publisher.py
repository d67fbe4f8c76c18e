"""KV events on the wire: vLLM's msgpack layout on a ZeroMQ PUB socket, replay, drops, and a live server.

The decoder below mirrors vLLM's ``vllm/distributed/kv_events.py`` structs (msgspec,
``array_like`` tagged unions, the positional layout llm-d's precise prefix-cache scorer
reads); it is written here, apart from the server's, so the two are checked against each other.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from api_factories import API_KEY, MODEL_NAME, live_server, wait_until_idle

from pagedllm.server.config import ConfigError, KVEventsConfig
from pagedllm.server.core import kv_events as core
from pagedllm.server.core.block_manager import block_hash
from pagedllm.server.engine.kv_event_publisher import ZmqEventPublisher, encode_batch, is_bind_endpoint
from tests.support import free_port

TOPIC = "kv@pod-1@tiny"


# -- vLLM's classes, as a subscriber declares them ----------------------------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
H1, H2, H3 = (1 << 64) - 1, 2, 12345678901234567890


def sample_events() -> list[core.KVCacheEvent]:
    return [
        core.BlockStored((H1, H2), None, tuple(range(8)), 4),
        core.BlockStored((H3,), H2, (8, 9, 10, 11), 4),
        core.BlockRemoved((H1,)),
        core.AllBlocksCleared(),
    ]


def test_the_payload_is_vllms_positional_layout():
    payload = encode_batch(msgspec.msgpack.Encoder(), 1.5, sample_events())
    assert msgspec.msgpack.decode(payload) == [
        1.5,
        [
            ["BlockStored", [H1, H2], None, list(range(8)), 4, None, "GPU", None],
            ["BlockStored", [H3], H2, [8, 9, 10, 11], 4, None, "GPU", None],
            ["BlockRemoved", [H1], "GPU"],
            ["AllBlocksCleared"],
        ],
        0,
    ]


def test_vllms_decoder_reads_the_payload():
    batch = DECODER.decode(encode_batch(msgspec.msgpack.Encoder(), 2.25, sample_events()))
    assert batch.ts == 2.25 and batch.data_parallel_rank == 0
    assert batch.events == [
        BlockStored([H1, H2], None, list(range(8)), 4, None, "GPU", None),
        BlockStored([H3], H2, [8, 9, 10, 11], 4, None, "GPU", None),
        BlockRemoved([H1], "GPU"),
        AllBlocksCleared(),
    ]


@pytest.mark.parametrize(
    "endpoint, bind",
    [("tcp://*:5557", True), ("tcp://[::]:5557", True), ("ipc:///tmp/kv", True), ("tcp://router:5557", False)],
)
def test_wildcard_and_local_addresses_are_bound_others_connected_to(endpoint, bind):
    assert is_bind_endpoint(endpoint) is bind


# -- the publisher --------------------------------------------------------------------------------------
class Subscriber:
    """A SUB socket bound on loopback that a thread of its own keeps reading, as a router does.

    NOTE: a bound ZeroMQ socket takes in a connecting peer (and sends it the subscription)
    only while its owner calls into it, so a subscriber that is not being read when a
    publisher connects would make the publisher drop its first batch.
    """

    def __init__(self, topic: str = "kv@") -> None:
        self.messages: queue.Queue[list[bytes]] = queue.Queue()
        self._stop = threading.Event()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(topic, ready), daemon=True)
        self._thread.start()
        assert ready.wait(10)

    def _run(self, topic: str, ready: threading.Event) -> None:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.endpoint = f"tcp://127.0.0.1:{sub.bind_to_random_port('tcp://127.0.0.1')}"
        ready.set()
        while not self._stop.is_set():
            if sub.poll(20):
                self.messages.put(sub.recv_multipart())
        ctx.destroy(linger=0)

    def receive(self, timeout_s: float = 10.0) -> list[bytes]:
        try:
            return self.messages.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError("no message in time") from None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def sub():
    subscriber = Subscriber()
    yield subscriber
    subscriber.close()


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def receive(sock: zmq.Socket, timeout_s: float = 10.0) -> list[bytes]:
    assert sock.poll(int(timeout_s * 1000)), "no message in time"
    return sock.recv_multipart()


def publisher_ready(publisher: ZmqEventPublisher, sub: Subscriber) -> None:
    """Publish probes until the subscriber sees one: the batches before a subscription arrives are lost."""
    for _ in range(200):
        publisher.publish([core.AllBlocksCleared()])
        try:
            sub.receive(timeout_s=0.05)
        except AssertionError:
            continue
        time.sleep(0.2)
        while not sub.messages.empty():
            sub.messages.get()
        return
    raise AssertionError("the subscriber never connected")


def test_batches_go_out_in_order_with_topic_and_sequence(sub):
    publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=sub.endpoint, topic=TOPIC))
    try:
        publisher_ready(publisher, sub)
        first = publisher.num_published
        events = sample_events()
        for event in events:
            publisher.publish([event])
        frames = [sub.receive() for _ in events]
    finally:
        publisher.close()
    assert [f[0] for f in frames] == [TOPIC.encode()] * 4
    assert [int.from_bytes(f[1], "big") for f in frames] == [first, first + 1, first + 2, first + 3]
    assert [DECODER.decode(f[2]).events[0] for f in frames] == [
        BlockStored([H1, H2], None, list(range(8)), 4, None, "GPU", None),
        BlockStored([H3], H2, [8, 9, 10, 11], 4, None, "GPU", None),
        BlockRemoved([H1], "GPU"),
        AllBlocksCleared(),
    ]
    assert publisher.num_dropped == 0


def test_replay_sends_kept_batches_from_a_sequence_number(context):
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://127.0.0.1:{free_port()}",  # NOTE: nobody listens: every batch is only kept for replay
        replay_endpoint=replay_endpoint,
        buffer_steps=3,
        topic=TOPIC,
    )
    publisher = ZmqEventPublisher(config)
    try:
        for i in range(5):
            publisher.publish([core.BlockRemoved((i,))])
        _wait_for(lambda: publisher.num_published == 5)
        client = context.socket(zmq.DEALER)
        client.connect(replay_endpoint)
        client.send_multipart([b"", (3).to_bytes(8, "big")])
        replies = [receive(client) for _ in range(3)]
    finally:
        publisher.close()
    assert [r[:2] for r in replies[:2]] == [[b"", TOPIC.encode()]] * 2
    assert [int.from_bytes(r[2], "big") for r in replies[:2]] == [3, 4]
    assert [DECODER.decode(r[3]).events for r in replies[:2]] == [
        [BlockRemoved([3], "GPU")],
        [BlockRemoved([4], "GPU")],
    ]
    assert replies[2] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]


def test_a_full_queue_drops_the_oldest_batch_and_counts_it(sub, monkeypatch):
    publisher = ZmqEventPublisher(
        KVEventsConfig(enable_kv_cache_events=True, endpoint=sub.endpoint, topic=TOPIC, max_queue_size=2)
    )
    publisher_ready(publisher, sub)
    first = publisher.num_published
    sending, release = threading.Event(), threading.Event()
    send = publisher._send

    def slow_send(*args):
        sending.set()
        release.wait(10)
        send(*args)

    monkeypatch.setattr(publisher, "_send", slow_send)
    try:
        publisher.publish([core.BlockRemoved((0,))])
        assert sending.wait(10)  # the thread holds batch `first`, stuck on the network
        started = time.monotonic()
        for i in (1, 2, 3):
            publisher.publish([core.BlockRemoved((i,))])
        assert time.monotonic() - started < 1.0  # publish never waits for the thread
        assert publisher.num_dropped == 1
        release.set()
        frames = [sub.receive() for _ in range(3)]
    finally:
        release.set()
        publisher.close()
    assert [int.from_bytes(f[1], "big") - first for f in frames] == [0, 2, 3]  # the gap shows the loss
    assert [DECODER.decode(f[2]).events[0].block_hashes for f in frames] == [[0], [2], [3]]


def test_an_endpoint_in_use_is_refused_naming_it(context):
    taken = context.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    with pytest.raises(ConfigError) as error:
        ZmqEventPublisher(
            KVEventsConfig(
                enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{free_port()}", replay_endpoint=endpoint
            )
        )
    assert error.value.field == "kv_events_config.replay_endpoint"
    assert endpoint in str(error.value) and "could not be bound" in str(error.value)


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# -- a live server ------------------------------------------------------------------------------------------
BLOCK = 4


def published_hashes(tokens: list[int]) -> list[int]:
    keys: list[bytes] = []
    for i in range(len(tokens) // BLOCK):
        keys.append(block_hash(keys[-1] if keys else b"", tokens[i * BLOCK : (i + 1) * BLOCK]))
    return [core.external_hash(k) for k in keys]


def collect_stored(sub: Subscriber, count: int, seqs: list[int]) -> list[BlockStored]:
    """BlockStored events until ``count`` blocks were stored; the sequence numbers go to ``seqs``."""
    stored: list[BlockStored] = []
    while sum(len(e.block_hashes) for e in stored) < count:
        topic, seq, payload = sub.receive(timeout_s=60)
        assert topic == TOPIC.encode()
        seqs.append(int.from_bytes(seq, "big"))
        stored += [e for e in DECODER.decode(payload).events if isinstance(e, BlockStored)]
    return stored


@pytest.mark.timeout(300)
def test_a_server_publishes_the_blocks_two_requests_with_a_shared_prefix_store(tiny_llama, sub):
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": sub.endpoint, "topic": TOPIC})
    first = list(range(40, 52))  # 3 full blocks
    second = first[:8] + list(range(60, 68))  # shares 2 of them, then 2 blocks of its own
    seqs: list[int] = []
    stored: list[BlockStored] = []
    with live_server(tiny_llama, block_size=BLOCK, kv_events_config=config) as server:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
            for prompt in (first, second):
                body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
                assert client.post("/v1/completions", json=body).status_code == 200
                stored += collect_stored(sub, 3 if prompt is first else 2, seqs)
            metrics = client.get("/metrics").text
        wait_until_idle(server)
        assert server.engine.submit(lambda engine: engine.reset_prefix_cache()).result(30) is True
        topic, seq, payload = sub.receive()
        cleared = DECODER.decode(payload)
    a, b = published_hashes(first), published_hashes(second)
    assert a[:2] == b[:2]
    assert stored == [
        BlockStored(a, None, first, BLOCK, None, "GPU", None),
        BlockStored(b[2:], a[1], second[8:], BLOCK, None, "GPU", None),  # chained under the shared prefix
    ]
    assert seqs == list(range(len(seqs))) and int.from_bytes(seq, "big") == len(seqs)
    assert cleared.events == [AllBlocksCleared()] and cleared.data_parallel_rank == 0
    assert abs(cleared.ts - time.time()) < 60
    assert 'pagedllm:kv_event_batches_dropped_total{model_name="tiny"} 0.0' in metrics
