"""The worker's batched sampler against a plain row-by-row reference, on fresh random logits each run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fault_doubles import PoisonSampler

from pagedllm.server.worker import sampler as sampler_module
from pagedllm.server.worker.logits_processors import filtered_probs, process
from pagedllm.server.worker.sampler import Sampler
from pagedllm.server.worker.sampling_batch import PromptScoring, RowSampling, SamplingBatch, SpecVerify

VOCAB = 64
CPU = torch.device("cpu")


def fresh_logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB) * 3


def pack(allowed: list[int]) -> np.ndarray:
    """xgrammar's bitmask of the ``allowed`` ids: int32 words, bit j of word w for token 32 w + j."""
    words = np.zeros(-(-VOCAB // 32), dtype=np.int64)
    for token in allowed:
        words[token // 32] |= 1 << (token % 32)
    return words.astype(np.uint32).view(np.int32)


def ids(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def mixed_rows() -> list[RowSampling]:
    penalties = dict(prompt_token_ids=ids([1, 2, 3, 9]), output_token_ids=ids([3, 3, 7]))
    return [
        RowSampling("greedy"),
        RowSampling("greedy-logprobs", num_logprobs=3, needs_logprobs=True),
        RowSampling("top-k", temperature=0.8, top_k=5, seed=1, needs_logprobs=True),
        RowSampling("top-p", temperature=1.2, top_p=0.7, seed=2, needs_logprobs=True, num_logprobs=0),
        RowSampling("min-p", temperature=0.6, min_p=0.2, seed=3, needs_logprobs=True),
        RowSampling(
            "penalties",
            temperature=0.9,
            repetition_penalty=1.4,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            seed=4,
            needs_logprobs=True,
            **penalties,
        ),
        RowSampling("penalized-greedy", repetition_penalty=1.8, frequency_penalty=0.7, **penalties),
        RowSampling("bias-ban", temperature=1.0, seed=5, logit_bias=((7, 4.0), (8, -2.0)), banned_token_ids=(0, 1)),
        RowSampling("mask", temperature=1.0, seed=6, allowed=pack([3, 10, 40, 63]), needs_logprobs=True),
        RowSampling("best-of", temperature=1.0, seed=7, num_samples=3, needs_logprobs=True, num_logprobs=2),
        RowSampling("unseeded", temperature=1.0, needs_logprobs=True),
    ]


def reference_logits(logits: torch.Tensor, row: RowSampling) -> torch.Tensor:
    """One row's processors, written plainly: penalties, min_tokens ban, bias, grammar mask."""
    logits = logits.clone()
    if row.penalized:
        output = [int(t) for t in row.output_token_ids]
        for token in set(int(t) for t in row.prompt_token_ids) | set(output):
            value, p = logits[token], row.repetition_penalty
            logits[token] = (value / p if value > 0 else value * p).clamp(-1e30, 1e30)
        for token in set(output):
            logits[token] -= row.frequency_penalty * output.count(token) + row.presence_penalty
    for token in row.banned_token_ids:
        logits[token] = float("-inf")
    for token, value in row.logit_bias:
        logits[token] += value
    if row.allowed is not None:
        allowed = [(int(row.allowed[t // 32]) >> (t % 32)) & 1 for t in range(VOCAB)]
        logits[torch.tensor(allowed) == 0] = float("-inf")
    return logits


def reference_probs(logits: torch.Tensor, row: RowSampling) -> torch.Tensor:
    """Temperature; top-k; then top-p and min-p on the top-k's probabilities (the top token always stays)."""
    scaled = logits / row.temperature
    order = scaled.argsort(descending=True).tolist()
    ranked = order[: row.top_k] if row.top_k else order
    probs = torch.softmax(scaled[ranked], dim=-1).tolist()
    keep, before = [], 0.0
    for rank, (token, p) in enumerate(zip(ranked, probs)):
        if rank == 0 or (before < row.top_p and p >= row.min_p * probs[0]):
            keep.append(token)
        before += p
    masked = torch.full_like(scaled, float("-inf"))
    masked[keep] = scaled[keep]
    return torch.softmax(masked, dim=-1)


def reference_tokens(logits: torch.Tensor, row: RowSampling, generator: torch.Generator) -> list[int]:
    processed = reference_logits(logits, row)
    if row.greedy:
        return [int(processed.argmax())] * row.num_samples
    return torch.multinomial(reference_probs(processed, row), row.num_samples, True, generator=generator).tolist()


def run(rows: list[RowSampling], logits: torch.Tensor, sampler: Sampler | None = None):
    sampler = sampler or Sampler(0, CPU)
    return sampler(logits, None, SamplingBatch(rows, len(rows))).rows


def test_mixed_rows_match_the_reference():
    rows, logits = mixed_rows(), fresh_logits(len(mixed_rows()))
    got = run(rows, logits)
    unseeded = torch.Generator().manual_seed(0)
    for row, tokens, row_logits in zip(rows, got, logits):
        generator = torch.Generator().manual_seed(row.seed) if row.seed is not None else unseeded
        assert tokens.token_ids == reference_tokens(row_logits, row, generator), row.request_id
        raw = torch.log_softmax(row_logits, dim=-1)
        if row.needs_logprobs or row.num_logprobs is not None:
            assert tokens.logprobs == pytest.approx([float(raw[t]) for t in tokens.token_ids], abs=1e-5)
        else:
            assert tokens.logprobs is None  # a greedy row without logprobs: argmax only
        if row.num_logprobs is not None:
            top = raw.topk(row.num_logprobs).indices.tolist()
            assert [[t for t, _ in entry] for entry in tokens.top] == [top] * len(tokens.token_ids)
            assert tokens.ranks == [int((raw > raw[t]).sum()) + 1 for t in tokens.token_ids]
    assert all(t not in (0, 1) for t in got[7].token_ids) and got[8].token_ids[0] in (3, 10, 40, 63)


def test_processed_logits_and_filtered_probabilities_match_the_reference():
    rows, logits = mixed_rows(), fresh_logits(len(mixed_rows()))
    processed = process(logits, rows)
    for i, row in enumerate(rows):
        assert torch.equal(processed[i], reference_logits(logits[i], row)), row.request_id
    drawn = [i for i, row in enumerate(rows) if not row.greedy]
    probs = filtered_probs(processed[drawn], [rows[i] for i in drawn])
    for j, i in enumerate(drawn):
        assert torch.allclose(probs[j], reference_probs(processed[i], rows[i]), atol=1e-6), rows[i].request_id
    assert process(logits, [RowSampling("plain")] * len(rows)) is logits  # nothing to do: no copy


def test_a_batch_draws_what_each_row_draws_alone():
    rows, logits = mixed_rows()[:-1], fresh_logits(len(mixed_rows()) - 1)  # seeded or greedy rows only
    batch = run(rows, logits)
    alone = [run([row], logits[i : i + 1])[0] for i, row in enumerate(rows)]
    assert batch == alone


def test_seeded_generators_live_per_request_until_forgotten():
    row = RowSampling("r", temperature=1.0, seed=11)
    logits = fresh_logits(1)
    sampler = Sampler(0, CPU)
    first = [run([row], logits, sampler)[0].token_ids[0] for _ in range(20)]
    reference = torch.Generator().manual_seed(11)
    probs = torch.softmax(logits[0], dim=-1)
    assert first == [int(torch.multinomial(probs, 1, True, generator=reference)) for _ in range(20)]
    sampler.forget(["r"])
    assert [run([row], logits, sampler)[0].token_ids[0] for _ in range(20)] == first  # made afresh from the seed


def test_greedy_rows_without_logprobs_skip_the_log_softmax(monkeypatch):
    calls = []
    real = torch.log_softmax

    def counting(x, dim):
        calls.append(x.shape[0])
        return real(x, dim)

    monkeypatch.setattr(sampler_module.torch, "log_softmax", counting)
    logits = fresh_logits(6)
    out = run([RowSampling(f"g{i}") for i in range(6)], logits)
    assert calls == [] and [t.token_ids for t in out] == [[t] for t in logits.argmax(-1).tolist()]
    run([RowSampling(f"g{i}") for i in range(5)] + [RowSampling("lp", num_logprobs=0)], logits)
    assert calls == [1]  # only the row that asked for logprobs


def test_a_complete_grammar_wins_over_min_tokens():
    logits = fresh_logits(1)
    row = RowSampling("r", allowed=pack([5]), banned_token_ids=(5, 6))
    assert run([row], logits)[0].token_ids == [5]


def test_a_raising_row_fails_its_request_alone():
    rows = [RowSampling("ok-1", temperature=1.0, seed=1), RowSampling("poison"), RowSampling("ok-2")]
    logits = fresh_logits(3)
    sampler = PoisonSampler(0, CPU, "poison")  # a test double: raises while "poison" is among its rows
    out = sampler(logits, None, SamplingBatch(rows, 3))
    assert out.rows[1] is None and "injected fault" in out.errors["poison"] and set(out.errors) == {"poison"}
    assert [out.rows[0], out.rows[2]] == run([rows[0], rows[2]], logits[[0, 2]])


def test_beam_rows_return_their_best_candidates():
    logits = fresh_logits(2)
    rows = [RowSampling("b", num_beam_candidates=4), RowSampling("b", num_beam_candidates=4)]
    out = run(rows, logits)
    for tokens, row_logits in zip(out, logits):
        values, top = torch.log_softmax(row_logits, -1).topk(4)
        assert tokens.token_ids == top.tolist() and tokens.logprobs == pytest.approx(values.tolist())


def test_prompt_scoring_gives_each_tokens_logprob_rank_and_top():
    prompt_logits = fresh_logits(5)
    prompts = [PromptScoring("a", (3, 9), 2), PromptScoring("b", (1, 2, 60), 0)]
    out = Sampler(0, CPU)(torch.zeros(0, VOCAB), prompt_logits, SamplingBatch([], 0, prompts=prompts)).prompts
    raw = torch.log_softmax(prompt_logits, -1)
    tokens = [3, 9, 1, 2, 60]
    assert out[0].logprobs + out[1].logprobs == pytest.approx([float(raw[i, t]) for i, t in enumerate(tokens)])
    assert out[0].ranks + out[1].ranks == [int((raw[i] > raw[i, t]).sum()) + 1 for i, t in enumerate(tokens)]
    assert [[t for t, _ in top] for top in out[0].top] == raw[:2].topk(2).indices.tolist()
    assert out[1].top == [[], [], []]


def test_verification_accepts_what_plain_decoding_would_emit():
    logits = fresh_logits(8)
    best = logits.argmax(-1).tolist()
    greedy_drafts = (best[0], best[1], (best[2] + 1) % VOCAB)  # two accepted, the third rejected
    seeded = RowSampling("s", temperature=0.7, seed=9)
    rows = [RowSampling("g")] * 4 + [seeded] * 4
    batch = SamplingBatch(rows, 0, [SpecVerify(0, greedy_drafts), SpecVerify(4, (1, 2, 3))])
    out = Sampler(0, CPU)(logits, None, batch).verified
    assert out[0].token_ids == best[:3]
    generator, emitted = torch.Generator().manual_seed(9), []
    for i, draft in enumerate([1, 2, 3, None]):  # one draw per emitted token, as without proposals
        emitted.append(int(torch.multinomial(torch.softmax(logits[4 + i] / 0.7, -1), 1, True, generator=generator)))
        if emitted[-1] != draft:
            break
    assert out[1].token_ids == emitted


def test_a_launched_draw_reads_back_what_a_call_returns():
    """``launch`` (async scheduling) gives, once read, the tokens, logprobs and device ids a call gives."""
    rows, logits = mixed_rows(), fresh_logits(len(mixed_rows()))
    batch = SamplingBatch(rows, len(rows))
    called, launcher = Sampler(5, CPU), Sampler(5, CPU)
    expected = called(logits, None, batch)
    read = launcher.launch(logits, None, batch)
    assert torch.equal(launcher.last_tokens, called.last_tokens)
    assert read() == expected and not expected.errors


def test_a_launched_draw_with_a_raising_row_fails_that_request_alone():
    rows = [RowSampling("ok-1", temperature=1.0, seed=1), RowSampling("poison"), RowSampling("ok-2")]
    logits = fresh_logits(3)
    out = PoisonSampler(0, CPU, "poison").launch(logits, None, SamplingBatch(rows, 3))()
    assert out.rows[1] is None and set(out.errors) == {"poison"}
    assert [out.rows[0], out.rows[2]] == run([rows[0], rows[2]], logits[[0, 2]])


def test_a_failed_read_back_fails_every_row_of_the_step(monkeypatch):
    rows = [RowSampling("a"), RowSampling("b", temperature=1.0, seed=3)]

    def broken_launch(self, logits, rows, units, defer=False):
        def read():
            raise RuntimeError("the copy to the host failed")

        return read

    monkeypatch.setattr(Sampler, "_launch_rows", broken_launch)
    out = Sampler(0, CPU).launch(fresh_logits(2), None, SamplingBatch(rows, 2))()
    assert out.rows == [None, None] and set(out.errors) == {"a", "b"}
    assert "the copy to the host failed" in out.errors["a"]


def test_beam_rows_launched_are_read_back_at_once():
    rows = [RowSampling("b", num_beam_candidates=3), RowSampling("g")]
    logits = fresh_logits(2)
    expected = Sampler(0, CPU)(logits, None, SamplingBatch(rows, 2))
    assert Sampler(0, CPU).launch(logits, None, SamplingBatch(rows, 2))() == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_launched_draw_does_not_wait_for_the_device():
    """The draw, its logprobs and the copies to the host are queued; only the read waits (sync debug mode)."""
    device = torch.device("cuda")
    rows = [RowSampling("g"), RowSampling("lp", num_logprobs=2, needs_logprobs=True), RowSampling("r", temperature=1.0)]
    logits = fresh_logits(3).to(device)
    sampler = Sampler(0, device)
    expected = Sampler(0, device)(logits, None, SamplingBatch(rows, 3))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        read = sampler.launch(logits, None, SamplingBatch(rows, 3))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert read() == expected
