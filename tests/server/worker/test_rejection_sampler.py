"""Acceptance of proposals: greedy keeps the argmax tokens; sampling keeps the target's distribution."""

from __future__ import annotations

import itertools

import torch

from pagedllm.server.worker.rejection_sampler import greedy_accept, sample_accept

VOCAB = 4
TRIALS = 15_000
# Chi-square critical value at p = 0.001, by degrees of freedom: a correct sampler fails 1 run in 1000
# (a fixed seed makes each run the same).
CHI2_999 = {3: 16.27, 15: 37.70}


def test_greedy_accepts_up_to_the_first_mismatch():
    assert greedy_accept([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]  # all accepted, then the bonus token
    assert greedy_accept([4, 9, 6, 7], [4, 5, 6]) == [4, 9]  # the target's token replaces the first miss
    assert greedy_accept([1, 5], [4]) == [1]
    assert greedy_accept([3], []) == [3]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def target_and_draft(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(3, VOCAB, generator=g) * 1.5, dim=-1)
    draft = torch.softmax(torch.randn(2, VOCAB, generator=g) * 1.5, dim=-1)
    return target, draft


def two_token_counts(target, draft_probs, drafts_of, generator) -> torch.Tensor:
    """How often each pair of first two emitted tokens came out over TRIALS runs."""
    counts = torch.zeros(VOCAB * VOCAB)
    for _ in range(TRIALS):
        out = sample_accept(target, drafts_of(), generator, draft_probs)
        while len(out) < 2:  # NOTE: a rejection ends the step; the next step samples from the same target here
            out += sample_accept(target[len(out) :], [], generator)
        counts[out[0] * VOCAB + out[1]] += 1
    return counts


def test_one_hot_drafts_keep_the_target_distribution():
    target, _ = target_and_draft(0)
    generator = torch.Generator().manual_seed(1)
    drafts = itertools.cycle([[0, 1], [2, 2], [3, 0], [1, 3]])  # fixed proposals of every kind
    counts = two_token_counts(target, None, lambda: next(drafts), generator)
    # the first two tokens are independent draws from target[0] and target[1]
    joint = (target[0][:, None] * target[1][None, :]).flatten()
    assert chi_square(counts, joint) < CHI2_999[15]


def test_drafts_from_a_distribution_keep_the_target_distribution():
    target, draft = target_and_draft(2)
    generator = torch.Generator().manual_seed(3)
    draw = torch.Generator().manual_seed(4)

    def drafts() -> list[int]:
        return [int(torch.multinomial(draft[i], 1, generator=draw)) for i in range(2)]

    counts = two_token_counts(target, draft, drafts, generator)
    joint = (target[0][:, None] * target[1][None, :]).flatten()
    assert chi_square(counts, joint) < CHI2_999[15]


def test_a_wrong_acceptance_rule_is_caught():
    """The check above has power: always accepting a drafted token is far from the target."""
    target, draft = target_and_draft(2)
    draw = torch.Generator().manual_seed(4)
    counts = torch.zeros(VOCAB)
    for _ in range(TRIALS // 4):
        counts[int(torch.multinomial(draft[0], 1, generator=draw))] += 1
    assert chi_square(counts, target[0]) > CHI2_999[3]


def test_one_hot_sampling_uses_the_draws_plain_sampling_would():
    """With a seed, the emitted tokens are those sampling without proposals draws, one per token."""
    target, _ = target_and_draft(5)
    plain = torch.Generator().manual_seed(6)
    expected = [int(torch.multinomial(target[i], 1, replacement=True, generator=plain)) for i in range(3)]
    speculative = torch.Generator().manual_seed(6)
    out = sample_accept(target, [expected[0], (expected[1] + 1) % VOCAB], speculative)
    assert out == expected[:2]
    again = torch.Generator().manual_seed(6)
    assert sample_accept(target, expected[:2], again) == expected
