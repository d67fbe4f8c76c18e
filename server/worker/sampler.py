"""From a step's logits to tokens, on the device that holds them: only token ids and asked log-probs leave.

Per step, for the rows of a :class:`~pagedllm.server.worker.sampling_batch.SamplingBatch`:

- the logits processors run batched (:mod:`~pagedllm.server.worker.logits_processors`);
- greedy rows take one ``argmax``; random rows get one batched filtered-probabilities
  pass, then one ``multinomial`` draw per row from that row's generator;
- beam rows return their best candidates (token ids and log-probabilities) instead;
- sequences verifying proposals are accepted by rejection sampling
  (:mod:`~pagedllm.server.worker.spec_verify`), prompt chunks are scored
  (:mod:`~pagedllm.server.worker.logprobs`).

Seeds: a seeded request's generator lives here, keyed by request id. It is made from the
seed the first time one of the request's rows is drawn (on the worker's device) and dropped
when a step lists the request as finished or aborted. A request draws from its generator
exactly as the engine did when it sampled on the host (one ``multinomial`` per row, in row
order), so seeded requests give the same tokens. Unseeded requests share the worker's
generator, seeded once from the engine's ``seed``. Only the driver (rank 0) keeps a
sampler: the other tensor-parallel ranks never sample.

NOTE: a greedy row that asked for no logprobs (and draws one sample per sequence) needs only
the argmax: its logprob is not computed (None), as vLLM reports no cumulative logprob for
such requests.

Failure isolation: a unit of work (a sample row, a verifying sequence, a prompt chunk) whose
sampling raises fails its request alone (:attr:`SamplerOutput.errors`): when the batched
pass raises, the units are run again one at a time to find the ones that raise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from pagedllm.server.worker.greedy import greedy_ids
from pagedllm.server.worker.logits_processors import filtered_probs, process
from pagedllm.server.worker.logprobs import gather_logprobs, tokens_of
from pagedllm.server.worker.sampling_batch import PromptScoring, RowSampling, SamplerOutput, SamplingBatch, Tokens
from pagedllm.server.worker.spec_verify import SpecVerifier

logger = logging.getLogger("pagedllm.worker")


class Sampler:
    """Draws a step's tokens; owns the per-request generators (see the module)."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        """Unseeded requests' generator."""
        self._generators: dict[str, torch.Generator] = {}
        """request id -> a seeded request's generator."""
        self.verifier = SpecVerifier(self.generator_of)
        self.last_tokens: torch.Tensor | None = None
        """[sample rows] int64 on the device: the first id each sample row of the last call drew
        (None: the batched draw did not cover every row). A step scheduled ahead reads it."""

    def generator_of(self, row: RowSampling) -> torch.Generator:
        """The generator ``row`` draws from: its request's own when seeded, made on first use."""
        if row.seed is None:
            return self.generator
        generator = self._generators.get(row.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(row.seed)
            self._generators[row.request_id] = generator
        return generator

    @property
    def num_generators(self) -> int:
        """Seeded requests whose generators are kept."""
        return len(self._generators)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop finished requests' generators."""
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, prompt_logits: torch.Tensor | None, batch: SamplingBatch) -> SamplerOutput:
        """``logits``: [len(batch.rows), vocab]; ``prompt_logits``: one row per scored prompt token."""
        out = SamplerOutput([None] * batch.num_sample_rows, [None] * len(batch.verify), [None] * len(batch.prompts))
        logits = logits.float()  # NOTE: a no-op for the float32 LM heads; processors and draws run in float32
        rows, verify, prompts = batch.rows, batch.verify, batch.prompts
        self.last_tokens = None
        _fill(out.rows, out.errors, lambda units: self._sample(logits, rows, units), lambda i: rows[i].request_id)
        if self.last_tokens is not None and (out.errors or self.last_tokens.numel() != batch.num_sample_rows):
            self.last_tokens = None
        _fill(
            out.verified,
            out.errors,
            lambda units: self.verifier.verify(logits, rows, [verify[g] for g in units], units),
            lambda g: rows[verify[g].first_row].request_id,
        )
        if prompt_logits is not None:
            scored, starts = prompt_logits.float(), _starts(prompts)
            _fill(
                out.prompts,
                out.errors,
                lambda units: _score_prompts(scored, prompts, starts, units),
                lambda p: prompts[p].request_id,
            )
        return out

    def launch(
        self, logits: torch.Tensor, prompt_logits: torch.Tensor | None, batch: SamplingBatch
    ) -> Callable[[], SamplerOutput]:
        """Draw the step's tokens on the device and start copying them to the host without waiting;
        the returned call waits for the copy and gives what :meth:`__call__` would (``async_scheduling``).

        NOTE: a step that verifies proposals, scores prompts or has beam rows reads back at once
        (such steps are never followed ahead). On a GPU the copy goes to page-locked memory behind
        an event, so the next step can be queued before this one's tokens reach the host.
        """
        rows = batch.rows
        if batch.verify or prompt_logits is not None or not rows or any(row.num_beam_candidates for row in rows):
            out = self(logits, prompt_logits, batch)
            return lambda: out
        self.last_tokens = None
        try:
            read = self._launch_rows(logits.float(), rows, list(range(len(rows))), defer=True)
        except Exception:
            out = self(logits, prompt_logits, batch)  # NOTE: one row at a time finds the rows that raise
            return lambda: out
        if self.last_tokens is not None and self.last_tokens.numel() != batch.num_sample_rows:
            self.last_tokens = None

        def finish() -> SamplerOutput:
            out = SamplerOutput([None] * batch.num_sample_rows, [], [None] * len(batch.prompts))
            try:
                results = read()
            except Exception as exc:
                for row in rows:
                    _fail(out.errors, row.request_id, exc)
                return out
            for unit, tokens in results.items():
                out.rows[unit] = tokens
            return out

        return finish

    def _sample(self, logits: torch.Tensor, rows: list[RowSampling], units: list[int]) -> dict[int, Tokens]:
        """Tokens (or beam candidates) of the sample rows ``units``."""
        return self._launch_rows(logits, rows, units)()

    def _launch_rows(
        self, logits: torch.Tensor, rows: list[RowSampling], units: list[int], defer: bool = False
    ) -> Callable[[], dict[int, Tokens]]:
        """The device work of :meth:`_sample`; the returned call reads the results back. ``defer``:
        the copies to the host are queued now (non-blocking on a GPU) and the call waits for them."""
        picked = [rows[i] for i in units]
        drawn = [k for k, row in enumerate(picked) if not row.num_beam_candidates]
        view = logits if len(units) == logits.shape[0] else logits[_index(units, logits.device)]
        tokens = self._draw(process(view, picked), picked, drawn)
        self.last_tokens = tokens[:, 0]
        wanted = [k for k in drawn if picked[k].needs_logprobs or picked[k].num_logprobs is not None]
        pending = None
        if wanted:
            index = _index(wanted, view.device)
            raw = torch.log_softmax(view[index], dim=-1)
            pending = gather_logprobs(raw, tokens[index], [picked[k].num_logprobs for k in wanted])
        beams = self._beam_candidates(view, picked)
        ready = None
        if defer and tokens.device.type == "cuda":
            tokens = _to_host(tokens)
            pending = pending.to_host(_to_host) if pending is not None else None
            ready = torch.cuda.Event()
            ready.record()

        def read() -> dict[int, Tokens]:
            if ready is not None:
                ready.synchronize()
            # NOTE: the step's read-back: everything above stays on the device until here.
            token_lists = tokens.tolist()
            results = {units[k]: Tokens(token_lists[k][: picked[k].num_samples]) for k in drawn}
            if pending is not None:
                counts = [picked[k].num_samples for k in wanted]
                for k, logprobs in zip(wanted, pending.tolist(counts, [picked[k].num_logprobs for k in wanted])):
                    results[units[k]] = Tokens(
                        results[units[k]].token_ids, logprobs.chosen, logprobs.ranks, logprobs.top
                    )
            results.update({units[k]: candidates for k, candidates in beams.items()})
            return results

        return read

    def _draw(self, logits: torch.Tensor, rows: list[RowSampling], drawn: list[int]) -> torch.Tensor:
        """[len(rows), most samples] token ids on the device: drawn row k's first ``num_samples`` are
        its draws (the rest repeat its first, so every row gathers at one width); beam rows stay 0."""
        width = max((rows[k].num_samples for k in drawn), default=1)
        greedy = [k for k in drawn if rows[k].greedy]
        if len(greedy) == len(rows):  # NOTE: the usual greedy batch: one argmax, nothing scattered
            return greedy_ids(logits).unsqueeze(-1).expand(-1, width)
        tokens = torch.zeros((len(rows), width), dtype=torch.int64, device=logits.device)
        if greedy:
            index = _index(greedy, logits.device)
            view = logits if len(greedy) == logits.shape[0] else logits[index]
            tokens[index] = greedy_ids(view).unsqueeze(-1).expand(-1, width)
        random = [k for k in drawn if not rows[k].greedy]
        if random:
            view = logits if len(random) == logits.shape[0] else logits[_index(random, logits.device)]
            probs = filtered_probs(view, [rows[k] for k in random])
            for j, k in enumerate(random):
                row = rows[k]
                draw = torch.multinomial(probs[j], row.num_samples, replacement=True, generator=self.generator_of(row))
                tokens[k] = _pad(draw, width)
        return tokens

    @staticmethod
    def _beam_candidates(logits: torch.Tensor, rows: list[RowSampling]) -> dict[int, Tokens]:
        """Per beam row: its ``num_beam_candidates`` likeliest tokens and their log-probabilities."""
        beams = [k for k, row in enumerate(rows) if row.num_beam_candidates]
        if not beams:
            return {}
        raw = torch.log_softmax(logits[_index(beams, logits.device)], dim=-1)
        width = min(max(rows[k].num_beam_candidates for k in beams), raw.shape[1])
        values, ids = (t.tolist() for t in raw.topk(width, dim=-1))
        return {
            k: Tokens(ids[j][: rows[k].num_beam_candidates], values[j][: rows[k].num_beam_candidates])
            for j, k in enumerate(beams)
        }


def _fill(
    target: list[Tokens | None],
    errors: dict[str, str],
    run: Callable[[list[int]], dict[int, Tokens]],
    request_of: Callable[[int], str],
) -> None:
    """``target[i] = run(all units)[i]``; if that raises, each unit alone, recording the requests of the
    units that raise in ``errors`` (their entries stay None)."""
    units = list(range(len(target)))
    if not units:
        return
    try:
        results = run(units)
    except Exception as exc:
        if len(units) == 1:
            _fail(errors, request_of(units[0]), exc)
            return
        results = {}
        for unit in units:  # NOTE: one at a time, to find the units that raise
            try:
                results.update(run([unit]))
            except Exception as unit_exc:
                _fail(errors, request_of(unit), unit_exc)
    for unit, tokens in results.items():
        target[unit] = tokens


def _fail(errors: dict[str, str], request_id: str, error: Exception) -> None:
    logger.error("request %s failed in sampling: %r", request_id, error, exc_info=error)
    errors.setdefault(request_id, f"sampling failed: {error!r}")


def _pad(tokens: torch.Tensor, width: int) -> torch.Tensor:
    """[width] ``tokens`` followed by copies of its first (the gather needs rows of one width)."""
    return torch.cat((tokens, tokens[:1].expand(width - tokens.numel())))


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    if device.type == "cuda":  # NOTE: page-locked and non-blocking: a copy from pageable memory waits for the stream
        return torch.tensor(rows, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _to_host(values: torch.Tensor) -> torch.Tensor:
    """A page-locked host copy of device ``values``, queued on the stream (valid once the stream passes it)."""
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    return host.copy_(values, non_blocking=True)


def _starts(prompts: list[PromptScoring]) -> list[int]:
    """Each prompt chunk's first row in the prompt logits."""
    starts, start = [], 0
    for prompt in prompts:
        starts.append(start)
        start += len(prompt.token_ids)
    return starts


def _score_prompts(
    logits: torch.Tensor, prompts: list[PromptScoring], starts: list[int], units: list[int]
) -> dict[int, Tokens]:
    """Each prompt chunk's tokens' log-probabilities, ranks and top ``num_logprobs``."""
    index = [r for p in units for r in range(starts[p], starts[p] + len(prompts[p].token_ids))]
    if not index:
        return {p: Tokens([], [], [], []) for p in units}
    raw = torch.log_softmax(logits[_index(index, logits.device)], dim=-1)
    ids = [t for p in units for t in prompts[p].token_ids]
    tokens = torch.tensor(ids, dtype=torch.int64, device=logits.device).unsqueeze(1)
    nums = [prompts[p].num_logprobs for p in units for _ in prompts[p].token_ids]
    per_row = gather_logprobs(raw, tokens, nums).tolist([1] * len(ids), nums)
    results, row = {}, 0
    for p in units:
        n = len(prompts[p].token_ids)
        results[p] = tokens_of(list(prompts[p].token_ids), per_row[row : row + n])
        row += n
    return results
