"""The sampler's batch paths (all greedy, all random, mixed, processed rows) against row-by-row calls."""

import torch

from pagedllm.server.engine.sampler import Sampler, SampleRequest
from pagedllm.server.sampling_params import SamplingParams


def requests():
    greedy = SamplingParams(temperature=0)
    return [
        SampleRequest(greedy, [1, 2], [3]),
        SampleRequest(SamplingParams(temperature=0, repetition_penalty=1.9), [1, 2], [3]),
        SampleRequest(SamplingParams(temperature=0.8, seed=1), [4], [], generator=torch.Generator().manual_seed(1)),
        SampleRequest(SamplingParams(temperature=0, logprobs=2), [5], [6, 7]),
        SampleRequest(greedy, [1], [], num_samples=3),
    ]


def test_batch_equals_row_by_row():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    batch = Sampler(0)(logits, requests())
    rows = [Sampler(0)(logits[i : i + 1], [req])[0] for i, req in enumerate(requests())]
    assert batch == rows
    assert batch[4].token_ids == [int(logits[4].argmax())] * 3
    assert batch[0].logprobs == [float(torch.log_softmax(logits[0], -1)[batch[0].token_ids[0]])]
    assert batch[3].top_logprobs[0] is not None and len(batch[3].top_logprobs[0]) >= 2


def test_all_greedy_and_all_random_batches():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    greedy = Sampler(0)(logits, [SampleRequest(SamplingParams(temperature=0), [1], []) for _ in range(4)])
    assert [s.token_ids[0] for s in greedy] == logits.argmax(-1).tolist()
    params = SamplingParams(temperature=1.0)
    drawn = Sampler(0)(logits, [SampleRequest(params, [1], []) for _ in range(4)])
    again = Sampler(0)(logits, [SampleRequest(params, [1], []) for _ in range(4)])
    assert drawn == again and all(0 <= s.token_ids[0] < 30 for s in drawn)
