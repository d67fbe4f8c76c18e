"""Request length distributions following the paper's workload statistics (seeded).

ShareGPT: mean input 161, mean output 338 tokens; Alpaca: 19 and 58. Lengths are
drawn from log-normal distributions with those means, clipped to [1, max_len].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

WORKLOADS = {
    # name: (mean input, mean output, sigma of log-length)
    "sharegpt": (161, 338, 0.8),
    "alpaca": (19, 58, 0.6),
}


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    output_len: int


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int, max_len: int) -> np.ndarray:
    mu = math.log(mean) - sigma**2 / 2  # so that the distribution's mean is `mean`
    return np.clip(np.round(rng.lognormal(mu, sigma, n)), 1, max_len).astype(int)


def sample_requests(
    workload: str, num: int, vocab_size: int, seed: int = 0, max_input: int = 1024, max_output: int = 1024
) -> list[Request]:
    """``num`` requests with random prompt tokens and the workload's length statistics."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload={workload!r} is unknown: choose one of {sorted(WORKLOADS)}")
    mean_in, mean_out, sigma = WORKLOADS[workload]
    rng = np.random.default_rng(seed)
    inputs = _lognormal(rng, mean_in, sigma, num, max_input)
    outputs = _lognormal(rng, mean_out, sigma, num, max_output)
    return [Request(rng.integers(0, vocab_size, n).tolist(), int(m)) for n, m in zip(inputs, outputs)]


def poisson_arrivals(num: int, rate: float, seed: int = 0, burstiness: float = 1.0) -> np.ndarray:
    """Arrival times (s) with mean rate ``rate``; burstiness < 1 is burstier (gamma intervals)."""
    rng = np.random.default_rng(seed)
    if math.isinf(rate):
        return np.zeros(num)
    intervals = rng.gamma(burstiness, 1.0 / (rate * burstiness), num)
    return np.cumsum(intervals) - intervals[0]
