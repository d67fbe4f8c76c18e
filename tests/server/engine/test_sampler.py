"""The sampler's batch paths (all greedy, all random, mixed, processed rows) against row-by-row calls."""

import pytest
import torch

from pagedllm.server.engine import sampler as sampler_module
from pagedllm.server.engine.sampler import Sampler, SampleRequest, TokenCounts
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
    assert batch[0].logprobs == [None]  # greedy, no logprobs asked: only the argmax is computed
    assert batch[3].logprobs == [float(torch.log_softmax(logits[3], -1)[batch[3].token_ids[0]])]
    assert batch[4].logprobs == [float(torch.log_softmax(logits[4], -1)[batch[4].token_ids[0]])] * 3
    assert batch[3].top_logprobs[0] is not None and len(batch[3].top_logprobs[0]) >= 2


def test_all_greedy_and_all_random_batches():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    greedy = Sampler(0)(logits, [SampleRequest(SamplingParams(temperature=0), [1], []) for _ in range(4)])
    assert [s.token_ids[0] for s in greedy] == logits.argmax(-1).tolist()
    params = SamplingParams(temperature=1.0)
    drawn = Sampler(0)(logits, [SampleRequest(params, [1], []) for _ in range(4)])
    again = Sampler(0)(logits, [SampleRequest(params, [1], []) for _ in range(4)])
    assert drawn == again and all(0 <= s.token_ids[0] < 30 for s in drawn)


def test_greedy_rows_without_logprobs_skip_the_log_softmax(monkeypatch):
    calls = []
    real = torch.log_softmax

    def counting(x, dim):
        calls.append(x.shape[0])
        return real(x, dim)

    monkeypatch.setattr(sampler_module.torch, "log_softmax", counting)
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    greedy = SamplingParams(temperature=0)
    out = Sampler(0)(logits, [SampleRequest(greedy, [1], []) for _ in range(6)])
    assert calls == []
    assert [s.token_ids for s in out] == [[t] for t in logits.argmax(-1).tolist()]
    reqs = [SampleRequest(greedy, [1], []) for _ in range(5)] + [
        SampleRequest(SamplingParams(temperature=0, logprobs=0), [1], [])
    ]
    out = Sampler(0)(logits, reqs)
    assert calls == [1]  # only the row that asked for logprobs
    assert out[5].logprobs == [float(real(logits[5], -1)[out[5].token_ids[0]])]


def _penalties_counted_afresh(logits: torch.Tensor, params: SamplingParams, prompt, output) -> None:
    """The penalties as computed before token counts were kept: from every token, each step."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.int64)
        values = logits[seen]
        p = params.repetition_penalty
        logits[seen] = torch.where(values > 0, values / p, values * p).clamp(min=-1e30, max=1e30)
    if (params.presence_penalty or params.frequency_penalty) and output:
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=logits.numel())
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, repetition_penalty=1.7),
        SamplingParams(temperature=0, presence_penalty=0.6, frequency_penalty=0.3),
        SamplingParams(temperature=0.9, repetition_penalty=0.8, presence_penalty=-0.4, frequency_penalty=0.7, seed=4),
    ],
)
def test_kept_token_counts_penalize_exactly_as_counting_afresh(params):
    g = torch.Generator().manual_seed(7)
    vocab, prompt, output = 64, torch.randint(0, 64, (30,), generator=g).tolist(), []
    counts = TokenCounts()
    for _ in range(25):
        logits = torch.randn(vocab, generator=g) * 3
        kept, afresh = logits.clone(), logits.clone()
        sampler_module._apply_penalties(kept, SampleRequest(params, prompt, output, counts=counts))
        _penalties_counted_afresh(afresh, params, prompt, output)
        assert torch.equal(kept, afresh)
        output.append(int(torch.randint(0, vocab, (1,), generator=g)))
    assert counts.num_counted == len(output) - 1  # counted up to the last step's tokens, once each


def test_engine_keeps_token_counts_per_sequence_and_matches_counting_afresh(tmp_path, monkeypatch):
    from pagedllm.server import LLM
    from tests.server.family_factories import save_tiny_family

    model = save_tiny_family(str(tmp_path), "mistral-window")
    params = SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.3, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 5, 9] * 3}, {"prompt_token_ids": [11, 12, 13]}]
    llm = LLM(model=model, block_size=8, num_gpu_blocks_override=32)
    first_calls: list[bool] = []
    real_update = TokenCounts.update

    def noting_update(self, prompt_ids, output_ids, vocab):
        first_calls.append(self.seen is None)
        real_update(self, prompt_ids, output_ids, vocab)

    monkeypatch.setattr(TokenCounts, "update", noting_update)
    kept = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert first_calls.count(True) == 2 and len(first_calls) == 2 * 12  # built once per sequence, then updated
    monkeypatch.setattr(sampler_module, "_apply_penalties", _afresh_from_request)
    afresh = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert kept == afresh


def _afresh_from_request(logits: torch.Tensor, req: SampleRequest) -> None:
    _penalties_counted_afresh(logits, req.params, req.prompt_token_ids, req.output_token_ids)
