"""The step profile's clock: the engine's step cut into named parts, each timed as it runs.

:func:`instrument` wraps the engine's scheduler, step builder, worker, attention ops and
sampler so that every decode step records how long each part took (:class:`Clock`);
:func:`components` sums those into the parts a step is reported in.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable


class Clock:
    """Wall seconds per label within the current step; a step's record when it ends."""

    def __init__(self) -> None:
        self.current: collections.Counter[str] = collections.Counter()
        self.steps: list[tuple[int, int, dict[str, float]]] = []  # (tokens, seqs, label -> seconds)
        self.shape = (0, 0)

    def timed(self, label: str, fn: Callable) -> Callable:
        current = self.current

        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                current[label] += time.perf_counter() - start

        return run

    def end_step(self) -> None:
        self.steps.append((*self.shape, dict(self.current)))
        self.current.clear()


class TimedSampler:
    """The worker's sampler behind a timer (``__call__`` cannot be wrapped on the instance)."""

    def __init__(self, sampler, clock: Clock) -> None:
        self._sampler = sampler
        self._call = clock.timed("sampler", sampler.__call__)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._sampler, name)


def instrument(engine, clock: Clock) -> None:
    """Wrap this engine's parts (instance attributes only; nothing global changes)."""
    from pagedllm.server.worker.attention import PagedAttention
    from pagedllm.server.worker.models.decoder import RMSNorm
    from pagedllm.server.worker.models.fused_linear import FusedLinear
    from pagedllm.server.worker.models.rope import RotaryEmbedding
    from pagedllm.server.worker.models.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from pagedllm.server.worker.quantization.linear import QuantLinear

    sched, runner = engine.scheduler, engine.runner
    schedule = clock.timed("schedule", sched.schedule)

    def schedule_and_note_shape():
        out = schedule()
        clock.shape = (out.num_batched_tokens, sum(len(item.chunks) for item in out.scheduled))
        return out

    sched.schedule = schedule_and_note_shape
    sched.updater.mark_computed = clock.timed("schedule", sched.updater.mark_computed)
    sched.free_finished = clock.timed("schedule", sched.free_finished)
    builder = engine.step_builder
    builder.build = clock.timed("step inputs", builder.build)
    engine.sampling_rows.build = clock.timed("step inputs", engine.sampling_rows.build)
    runner.execute = clock.timed("runner.execute", runner.execute)
    runner.sampler = TimedSampler(runner.sampler, clock)
    runner.ops = _timed_ops(runner.ops, clock)
    model = runner.model
    model.forward = clock.timed("model.forward", model.forward)
    model.compute_logits = clock.timed("LM head (logits)", model.compute_logits)
    model.model.embed_tokens.forward = clock.timed("embedding", model.model.embed_tokens.forward)
    kinds = (
        ((ColumnParallelLinear, RowParallelLinear, FusedLinear, QuantLinear), "linear (q, k, v, o, gate, up, down)"),
        (RMSNorm, "RMSNorm"),
        (RotaryEmbedding, "rotary"),
        (PagedAttention, "attention.forward"),
    )
    for module in model.model.modules():
        for cls, label in kinds:
            if isinstance(module, cls):
                module.forward = clock.timed(label, module.forward)
    # NOTE: deciding (text, stop checks, beams) and applying (the scheduler appends) count as one part
    engine.step_results.decide = clock.timed("step_results.apply", engine.step_results.decide)
    sched.updater.apply = clock.timed("step_results.apply", sched.updater.apply)
    processor = engine.output_processor
    processor.request_output = clock.timed("outputs (RequestOutput per request)", processor.request_output)


def _timed_ops(ops, clock: Clock):
    # NOTE: instance attributes shadow the methods of this runner's backend object only.
    ops.prepare = clock.timed("attention metadata", ops.prepare)
    ops.reshape_and_cache = clock.timed("KV write", ops.reshape_and_cache)
    ops.decode = clock.timed("decode attention kernel", ops.decode)
    return ops


def components(step: dict[str, float]) -> dict[str, float]:
    """One step's labels as disjoint parts (children subtracted from their parents)."""
    g = collections.defaultdict(float, step)
    leaf = ("embedding", "linear (q, k, v, o, gate, up, down)", "RMSNorm", "rotary", "attention.forward")
    return {
        "schedule (scheduler + block manager)": g["schedule"],
        "input preparation (step inputs, block tables)": g["step inputs"],
        "attention metadata (plan)": g["attention metadata"],
        "linear layers (q, k, v, o, gate, up, down)": g["linear (q, k, v, o, gate, up, down)"],
        "decode attention kernel": g["decode attention kernel"],
        "KV write": g["KV write"],
        "attention glue (views, output copy)": g["attention.forward"] - g["KV write"] - g["decode attention kernel"],
        "RMSNorm": g["RMSNorm"],
        "rotary": g["rotary"],
        "embedding": g["embedding"],
        "layer glue (SiLU * up, residual adds, Python)": g["model.forward"] - sum(g[k] for k in leaf),
        "LM head (logits)": g["LM head (logits)"],
        "worker glue (execute rest)": g["runner.execute"]
        - g["attention metadata"]
        - g["model.forward"]
        - g["LM head (logits)"]
        - g["sampler"],
        "sampler": g["sampler"],
        "token append, stop checks (step results rest)": g["step_results.apply"],
        "outputs (RequestOutput per request)": g["outputs (RequestOutput per request)"],
        "engine glue (step rest)": g["engine.step"]
        - g["schedule"]
        - g["step inputs"]
        - g["runner.execute"]
        - g["step_results.apply"]
        - g["outputs (RequestOutput per request)"],
    }
