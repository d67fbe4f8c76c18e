"""Prometheus metrics, named as vLLM's with the ``pagedllm:`` prefix, each labelled ``model_name``.

Two sources feed them:

* per-request counters and histograms, observed on the event loop from the outputs the
  async engine dispatches (:meth:`ServerMetrics.observe`);
* engine gauges and counters (queues, KV cache usage, preemptions, prefix cache), read
  from the engine's newest ``stats()`` snapshot at scrape time by a custom collector.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagedllm.server.config import EngineConfig
from pagedllm.server.config.quantization import WeightsSummary
from pagedllm.server.engine.engine_stats import EngineStats
from pagedllm.server.outputs import EmbeddingRequestOutput

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class ServerMetrics:
    """The server's metrics in their own registry (so several servers can live in one process)."""

    def __init__(
        self,
        model_name: str,
        config: EngineConfig,
        stats: Callable[[], EngineStats | None],
        weights: Callable[[], WeightsSummary | None] = lambda: None,
    ) -> None:
        self.model_name = model_name
        # NOTE: a process-wide switch: no `*_created` sample beside every counter and histogram.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry
        self.prompt_tokens = Counter("pagedllm:prompt_tokens", "Prompt tokens processed.", labels, registry=reg)
        self.generation_tokens = Counter("pagedllm:generation_tokens", "Tokens generated.", labels, registry=reg)
        self.request_success = Counter(
            "pagedllm:request_success",
            "Requests finished, by finish reason.",
            labels + ["finished_reason"],
            registry=reg,
        )
        self.ttft = Histogram(
            "pagedllm:time_to_first_token_seconds",
            "Arrival to first generated token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "pagedllm:inter_token_latency_seconds",
            "Time between a request's token steps.",
            labels,
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "pagedllm:e2e_request_latency_seconds",
            "Arrival to last token.",
            labels,
            buckets=REQUEST_BUCKETS,
            registry=reg,
        )
        self.queue_time = Histogram(
            "pagedllm:request_queue_time_seconds",
            "Arrival to first scheduled step.",
            labels,
            buckets=REQUEST_BUCKETS,
            registry=reg,
        )
        self.requests_rejected = Counter(
            "pagedllm:requests_rejected",
            "Requests turned away before reaching the engine, by reason (queue_full).",
            labels + ["reason"],
            registry=reg,
        )
        self.lora_requests = Counter(
            "pagedllm:lora_requests",
            "Requests run with a LoRA adapter, by adapter name.",
            labels + ["lora_name"],
            registry=reg,
        )
        reg.register(EngineStatsCollector(model_name, config, stats, weights))

    def count_rejected(self, reason: str) -> None:
        self.requests_rejected.labels(self.model_name, reason).inc()

    def count_lora_request(self, lora_name: str) -> None:
        self.lora_requests.labels(self.model_name, lora_name).inc()

    def observe(self, stream, output, times) -> None:
        """Called by the async engine for each output (``output is None``: the request was aborted)."""
        name = self.model_name
        if output is None:
            self.request_success.labels(name, "abort").inc()
            return
        if not stream.scheduled:
            self.queue_time.labels(name).observe(max(0.0, times.start - stream.arrival_time))
        if isinstance(output, EmbeddingRequestOutput):
            self._observe_embedding(stream, output, times)
            return
        tokens = sum(len(c.token_ids) for c in output.outputs)
        if tokens > stream.num_tokens:
            self.generation_tokens.labels(name).inc(tokens - stream.num_tokens)
            if stream.first_token_time is None:
                stream.first_token_time = times.end
                self.prompt_tokens.labels(name).inc(len(output.prompt_token_ids))
                self.ttft.labels(name).observe(max(0.0, times.end - stream.arrival_time))
            else:
                self.itl.labels(name).observe(max(0.0, times.end - stream.last_token_time))
            stream.last_token_time = times.end
            stream.num_tokens = tokens
        if output.error is not None:
            self.request_success.labels(name, "error").inc()
        elif output.finished:
            reason = output.outputs[0].finish_reason if output.outputs else "length"
            self.request_success.labels(name, reason or "stop").inc()
            self.e2e.labels(name).observe(max(0.0, times.end - stream.arrival_time))

    def _observe_embedding(self, stream, output: EmbeddingRequestOutput, times) -> None:
        """An embedding request generates nothing: its prompt tokens, its end and its latency."""
        name = self.model_name
        if output.error is not None:
            self.request_success.labels(name, "error").inc()
        elif output.finished:
            self.prompt_tokens.labels(name).inc(len(output.prompt_token_ids))
            self.request_success.labels(name, "stop").inc()
            self.e2e.labels(name).observe(max(0.0, times.end - stream.arrival_time))


class EngineStatsCollector(Collector):
    """Engine-owned numbers, read from the newest stats snapshot when Prometheus scrapes."""

    def __init__(
        self,
        model_name: str,
        config: EngineConfig,
        stats: Callable[[], EngineStats | None],
        weights: Callable[[], WeightsSummary | None] = lambda: None,
    ) -> None:
        self.model_name = model_name
        self.config = config
        self.stats = stats
        self.weights = weights
        """The loaded weights' summary (None until the engine has loaded them)."""

    def collect(self) -> Iterator:
        stats = self.stats()
        if stats is None:
            return
        labels, values = ["model_name"], [self.model_name]
        for name, doc, value in (
            ("num_requests_running", "Sequences running on the device.", stats.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("num_requests_swapped", "Requests swapped out to host memory.", stats.num_swapped),
            (
                "kv_cache_usage_perc",
                "Fraction of device KV cache blocks in use (0-1).",
                _usage(stats.num_gpu_blocks, stats.num_free_gpu_blocks),
            ),
            (
                "kv_blocks_in_use",
                "Device KV cache blocks held by requests (cached blocks nobody holds are free).",
                stats.num_gpu_blocks - stats.num_free_gpu_blocks,
            ),
            (
                "cpu_kv_cache_usage_perc",
                "Fraction of host (swap) KV cache blocks in use (0-1).",
                _usage(stats.num_cpu_blocks, stats.num_free_cpu_blocks),
            ),
        ):
            gauge = GaugeMetricFamily(f"pagedllm:{name}", doc, labels=labels)
            gauge.add_metric(values, value)
            yield gauge
        yield from self._vllm_names(stats)
        for name, doc, value in (
            ("num_preemptions", "Preemptions (recompute or swap) since start.", stats.num_preemptions),
            ("prefix_cache_queries", "Prefix cache lookups.", stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prefix cache lookups that found a cached block.", stats.prefix_cache_hits),
            (
                "kv_event_batches_dropped",
                "KV event batches dropped because the publisher's queue was full (--kv-events-config).",
                stats.kv_event_batches_dropped,
            ),
        ):
            counter = CounterMetricFamily(f"pagedllm:{name}", doc, labels=labels)
            counter.add_metric(values, value)
            yield counter
        yield from self._spec_decode(stats)
        if stats.max_lora:
            yield _lora_info(stats)
        yield self._cache_config_info(stats, "pagedllm:cache_config_info")
        weights = self.weights()
        if weights is not None:
            yield _quant_config_info(self.model_name, weights.labels())
        yield self._cache_config_info(stats, "vllm:cache_config_info")  # NOTE: prefix-aware routing reads it

    def _vllm_names(self, stats: EngineStats) -> Iterator:
        """The gauges under vLLM's names too: what the Gateway API Inference Extension's endpoint
        picker (and vLLM dashboards) read from a model server to route by queue and KV cache."""
        usage = _usage(stats.num_gpu_blocks, stats.num_free_gpu_blocks)
        for name, doc, value in (
            ("num_requests_waiting", "Requests waiting to be scheduled (same as pagedllm:).", stats.num_waiting),
            ("num_requests_running", "Requests running (the inference gateway's meaning).", stats.num_running_requests),
            ("kv_cache_usage_perc", "KV cache usage, 0-1 (same as pagedllm:).", usage),
            ("gpu_cache_usage_perc", "KV cache usage, 0-1 (vLLM's older name).", usage),
        ):
            gauge = GaugeMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            gauge.add_metric([self.model_name], value)
            yield gauge

    def _spec_decode(self, stats: EngineStats) -> Iterator:
        """Speculative decoding's counters under vLLM's names (and ours); nothing when it is off."""
        spec = stats.spec_decode
        if spec is None:
            return
        for prefix in ("vllm", "pagedllm"):
            for name, doc, value in (
                ("spec_decode_num_drafts", "Proposals verified (one per sequence per step).", spec.num_drafts),
                ("spec_decode_num_draft_tokens", "Proposed tokens verified.", spec.num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Proposed tokens accepted.", spec.num_accepted_tokens),
            ):
                counter = CounterMetricFamily(f"{prefix}:{name}", doc, labels=["model_name"])
                counter.add_metric([self.model_name], value)
                yield counter
            per_pos = CounterMetricFamily(
                f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
                "Proposed tokens accepted, by their position among the proposals (0 first).",
                labels=["model_name", "position"],
            )
            for position, value in enumerate(spec.accepted_per_pos):
                per_pos.add_metric([self.model_name, str(position)], value)
            yield per_pos

    def _cache_config_info(self, stats: EngineStats, name: str) -> GaugeMetricFamily:
        cache = self.config.cache
        info = {
            "model_name": self.model_name,
            "block_size": str(stats.block_size),
            "num_gpu_blocks": str(stats.num_gpu_blocks),
            "num_cpu_blocks": str(stats.num_cpu_blocks),
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization),
            "swap_space": str(cache.swap_space),
            "cache_dtype": cache.kv_cache_dtype,
        }
        gauge = GaugeMetricFamily(name, "Information of the KV cache configuration.", labels=list(info))
        gauge.add_metric(list(info.values()), 1.0)
        return gauge


def _quant_config_info(model_name: str, quant: dict[str, str]) -> GaugeMetricFamily:
    """The weights' quantization (method ``none`` for plain weights), bits, group size, the kernel of each
    linear kind on this device (``kernel_qkv_proj``, ...) and ``weight_bytes``, in the labels (like
    ``cache_config_info``)."""
    info = {"model_name": model_name, **quant}
    gauge = GaugeMetricFamily(
        "pagedllm:quant_config_info", "Information of the weight quantization.", labels=list(info)
    )
    gauge.add_metric(list(info.values()), 1.0)
    return gauge


def _lora_info(stats: EngineStats) -> GaugeMetricFamily:
    """vLLM's ``lora_requests_info``: the adapters running and waiting now in its labels, the time as its value."""
    labels = {
        "running_lora_adapters": ",".join(stats.running_lora_adapters),
        "waiting_lora_adapters": ",".join(stats.waiting_lora_adapters),
        "max_lora": str(stats.max_lora),
    }
    gauge = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.", labels=list(labels))
    gauge.add_metric(list(labels.values()), time.time())
    return gauge


def _usage(total: int, free: int) -> float:
    return 0.0 if total <= 0 else (total - free) / total
