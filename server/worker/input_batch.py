"""The worker's persistent batch: every sequence the scheduler told it about, kept across steps.

Each step's :class:`~pagedllm.server.core.scheduler_output.SchedulerOutput` brings new
sequences whole and known ones as diffs; :meth:`InputBatch.step` applies them to
preallocated arrays, one row per sequence, and builds the step's arrays, all of them, here::

    row  seq   tokens [rows, longest so far]      block_table [rows, max_blocks]   computed
     0    7    [p0 p1 .. p9 t10 t11  0 ...]       [ 4  9  2  0 ...]                11
     1    3    [q0 .. q4  0  ...]                 [ 5  0  0  0 ...]                 2
     2    -    (free: a finished sequence's row, reused by the next new one)

    step tokens: row of each scheduled token and its position p (from ``computed`` on)
      input_ids = tokens[row, p]      slot = block_table[row, p // B] * B + p % B
    decode block tables / prefill block tables = block_table[rows of the step, :widest row]

Rows are the batch's, not the step's: a sequence keeps its row from the step it is new to the
step it finishes, whatever the step order; the step gathers its rows in its own order.
Proposals being verified are written past a row's tokens, where the next accepted token
overwrites them.

Every tensor-parallel rank applies the same outputs, so every rank's batch is the same.

With ``lookahead`` (``async_scheduling``) a sequence's newest token may be
:data:`~pagedllm.server.core.scheduler_output.PLACEHOLDER_TOKEN_ID`, the token it sampled in
the step before, not known when this step was scheduled: the step lists where such tokens
are and which of the previous step's sample rows holds each (``ModelStep.placeholders``).
"""

from __future__ import annotations

import itertools

import numpy as np

from pagedllm.server.core.scheduler_output import CachedSeqs, NewSeqData, SchedulerOutput
from pagedllm.server.worker.model_step import ModelStep, StepAttention, StepLoRA

_EMPTY = np.zeros(0, dtype=np.int64)
INITIAL_TOKENS = 2048
"""Token columns a fresh batch starts with."""


class InputBatch:
    """Sequences by id, their tokens and block tables in preallocated arrays, updated by diffs."""

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, lookahead: bool = False) -> None:
        self.block_size = block_size
        self.lookahead = lookahead
        """Whether steps may hold placeholder tokens (scheduled ahead)."""
        rows, blocks = max(1, max_num_seqs), -(-max_model_len // block_size)
        # NOTE: int32 ids, and rows only as long as the longest sequence so far (they double as needed):
        # a long max_model_len costs memory only when sequences are that long.
        self.tokens = np.zeros((rows, max(1, min(max_model_len, INITIAL_TOKENS))), dtype=np.int32)
        self.block_table = np.zeros((rows, max(1, blocks)), dtype=np.int32)
        self.num_tokens = np.zeros(rows, dtype=np.int64)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.computed = np.zeros(rows, dtype=np.int64)
        self.lora_slot = np.zeros(rows, dtype=np.int64)
        self.row_of: dict[int, int] = {}
        self._free: list[int] = list(range(rows - 1, -1, -1))
        self._cached_rows = _EMPTY
        """The rows of the last output's cached sequences (its step reuses them when they are all it runs)."""
        self.sample_pos = np.full(rows, -1, dtype=np.int64)
        """Per row: its sample row in the last step built (-1: none); kept only with ``lookahead``."""
        self._sampled_rows = _EMPTY

    def __len__(self) -> int:
        return len(self.row_of)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.row_of

    def step(self, out: SchedulerOutput) -> ModelStep:
        """Apply ``out``'s diffs, then build the step it schedules."""
        self.apply(out)
        return self.build(out)

    # -- diffs --------------------------------------------------------------------------
    def apply(self, out: SchedulerOutput) -> None:
        """Forget what finished, add the new sequences, append the known ones' tokens and blocks."""
        if out.reset:
            self.row_of.clear()
            self._free = list(range(self.tokens.shape[0] - 1, -1, -1))
            self.sample_pos[:] = -1
        for seq_id in out.finished_seq_ids:
            row = self.row_of.pop(seq_id, None)
            if row is not None:
                self._free.append(row)
        for seq in out.new_seqs:
            self._add(seq)
        self._cached_rows = _EMPTY
        if out.cached_seqs.seq_ids:
            self._update(out.cached_seqs)

    def _add(self, seq: NewSeqData) -> None:
        row = self.row_of.get(seq.seq_id)
        if row is None:
            if not self._free:
                self._grow_rows()
            row = self.row_of[seq.seq_id] = self._free.pop()
        n, k = len(seq.token_ids), len(seq.block_ids)
        self._fit(n, k)
        self.tokens[row, :n] = seq.token_ids
        self.block_table[row, :k] = seq.block_ids
        self.block_table[row, k:] = 0
        self.num_tokens[row] = n
        self.num_blocks[row] = k
        self.computed[row] = seq.num_computed_tokens
        self.lora_slot[row] = seq.lora_slot

    def _update(self, cached: CachedSeqs) -> None:
        row_of = self.row_of
        rows = np.fromiter(map(row_of.__getitem__, cached.seq_ids), dtype=np.int64, count=len(cached.seq_ids))
        self._cached_rows = rows
        self.computed[rows] = cached.num_computed_tokens
        new_tokens = cached.new_token_ids
        counts = list(map(len, new_tokens))
        if counts.count(1) == len(counts):  # NOTE: the usual step: one new token each, one write
            ends = self.num_tokens[rows]
            self._fit(int(ends.max()) + 1, 0)
            self.tokens[rows, ends] = np.fromiter(itertools.chain.from_iterable(new_tokens), np.int32, len(counts))
            self.num_tokens[rows] = ends + 1
        else:
            for row, tokens in zip(rows.tolist(), new_tokens):
                if tokens:
                    n = int(self.num_tokens[row])
                    self._fit(n + len(tokens), 0)
                    self.tokens[row, n : n + len(tokens)] = tokens
                    self.num_tokens[row] = n + len(tokens)
        if not any(cached.new_block_ids) and True not in cached.replaced:
            return  # NOTE: most steps: a block holds block_size tokens
        for row, blocks, replaced in zip(rows.tolist(), cached.new_block_ids, cached.replaced):
            if not blocks and not replaced:
                continue
            if replaced:
                k = len(blocks)
                self._fit(0, k)
                self.block_table[row, :k] = blocks
                self.block_table[row, k:] = 0
            else:
                w = int(self.num_blocks[row])
                k = w + len(blocks)
                self._fit(0, k)
                self.block_table[row, w:k] = blocks
            self.num_blocks[row] = k

    # -- the step's arrays --------------------------------------------------------------
    def build(self, out: SchedulerOutput) -> ModelStep:
        """The step's host arrays (decodes, then verifications, then prefill chunks), from the rows."""
        n, nd, nv = len(out.scheduled_seq_ids), out.num_decodes, out.num_verifies
        if len(self._cached_rows) == n and out.cached_seqs.seq_ids == out.scheduled_seq_ids:
            rows = self._cached_rows  # NOTE: the usual step: every sequence was known, in step order
        else:
            rows = np.fromiter(map(self.row_of.__getitem__, out.scheduled_seq_ids), dtype=np.int64, count=n)
        starts = self.computed[rows]
        plain = nd == n
        if plain:  # NOTE: one token per sequence: rows and positions are the sequences'
            chunks = np.ones(n, dtype=np.int64)
            ends = np.arange(1, n + 1, dtype=np.int64)
            token_rows, positions = rows, starts
        else:
            chunks = np.array(out.num_scheduled_tokens, dtype=np.int64)
            if nv:
                self._write_proposals(out, rows[nd : nd + nv], starts[nd : nd + nv], chunks[nd : nd + nv])
            ends = np.cumsum(chunks)
            token_rows = np.repeat(rows, chunks)
            positions = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(ends - chunks - starts, chunks)
        bs = self.block_size
        index, offsets = np.divmod(positions, bs)
        slots = self.block_table[token_rows, index].astype(np.int64) * bs + offsets
        num_decode_tokens = n if plain else nd + int(chunks[nd : nd + nv].sum())
        tables, cu_seqlens, context_lens = (
            _no_prefills() if plain else self._prefills(rows[nd + nv :], starts[nd + nv :], chunks[nd + nv :])
        )
        meta = StepAttention(
            slot_mapping=slots,
            num_decode_tokens=num_decode_tokens,
            decode_block_tables=self._tables(token_rows[:num_decode_tokens]),
            decode_context_lens=(positions[:num_decode_tokens] + 1).astype(np.int32),
            prefill_block_tables=tables,
            prefill_cu_seqlens_q=cu_seqlens,
            prefill_context_lens=context_lens,
        )
        sample_index, prompt_index, pool_index, pool_lens = _row_indices(out, ends, plain)
        input_ids = self.tokens[token_rows, positions].astype(np.int64)
        placeholders = self._placeholders(out, input_ids, token_rows, rows) if self.lookahead else None
        lora = None
        if out.lora_adapters:
            lora = StepLoRA(np.repeat(self.lora_slot[rows], chunks), out.lora_adapters)
        return ModelStep(
            list(out.swap_out),
            list(out.swap_in),
            list(out.copies),
            input_ids,
            positions,
            meta,
            sample_index,
            prompt_index,
            pool_index,
            pool_lens,
            lora,
            out.sampling,
            placeholders,
        )

    def _placeholders(
        self, out: SchedulerOutput, input_ids: np.ndarray, token_rows: np.ndarray, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Where the step's placeholder tokens are and the previous step's sample row of each; then
        records this step's sample rows for the next."""
        holes = np.flatnonzero(input_ids < 0)
        found = None
        if holes.size:
            found = (holes, self.sample_pos[token_rows[holes]])
            if (found[1] < 0).any():
                raise RuntimeError("a placeholder token of a sequence that did not sample in the step before")
        self.sample_pos[self._sampled_rows] = -1
        if len(out.sample_seq_ids) == len(rows) and out.sample_seq_ids == out.scheduled_seq_ids:
            sampled = rows
        else:
            sampled = np.fromiter(map(self.row_of.__getitem__, out.sample_seq_ids), np.int64, len(out.sample_seq_ids))
        self.sample_pos[sampled] = np.arange(len(sampled), dtype=np.int64)
        self._sampled_rows = sampled
        return found

    def _prefills(
        self, rows: np.ndarray, starts: np.ndarray, chunks: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The prefill chunks' block tables, cumulative query lengths and context lengths."""
        cu_seqlens = np.concatenate(([0], np.cumsum(chunks))).astype(np.int32)
        return self._tables(rows), cu_seqlens, (starts + chunks).astype(np.int32)

    def _tables(self, rows: np.ndarray) -> np.ndarray:
        """Block-table rows of ``rows``, as wide as the widest of them (int32, a copy)."""
        if rows.size == 0:
            return np.zeros((0, 0), dtype=np.int32)
        return self.block_table[rows, : int(self.num_blocks[rows].max())]

    def _write_proposals(self, out: SchedulerOutput, rows: np.ndarray, starts: np.ndarray, chunks: np.ndarray) -> None:
        """Put each verifying sequence's proposals after its tokens, where its chunk reads them."""
        for row, start, chunk, drafts in zip(rows.tolist(), starts.tolist(), chunks.tolist(), out.spec_token_ids):
            n = int(self.num_tokens[row])
            wanted = start + chunk - n
            self._fit(n + wanted, 0)
            self.tokens[row, n : n + wanted] = drafts[:wanted]

    def _fit(self, num_tokens: int, num_blocks: int) -> None:
        """Wider arrays if a row needs more (beyond the engine's limits; not on the hot path)."""
        if num_tokens > self.tokens.shape[1]:
            self.tokens = _widened(self.tokens, max(num_tokens, 2 * self.tokens.shape[1]))
        if num_blocks > self.block_table.shape[1]:
            self.block_table = _widened(self.block_table, max(num_blocks, 2 * self.block_table.shape[1]))

    def _grow_rows(self) -> None:
        old = self.tokens.shape[0]
        self.tokens = np.concatenate((self.tokens, np.zeros_like(self.tokens)))
        self.block_table = np.concatenate((self.block_table, np.zeros_like(self.block_table)))
        for name in ("num_tokens", "num_blocks", "computed", "lora_slot"):
            setattr(self, name, np.concatenate((getattr(self, name), np.zeros(old, dtype=np.int64))))
        self.sample_pos = np.concatenate((self.sample_pos, np.full(old, -1, dtype=np.int64)))
        self._free.extend(range(2 * old - 1, old - 1, -1))


def _no_prefills() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.zeros((0, 0), dtype=np.int32), np.zeros(1, dtype=np.int32), np.zeros(0, dtype=np.int32)


def _widened(array: np.ndarray, width: int) -> np.ndarray:
    wider = np.zeros((array.shape[0], width), dtype=array.dtype)
    wider[:, : array.shape[1]] = array
    return wider


def _row_indices(
    out: SchedulerOutput, ends: np.ndarray, plain: bool
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """Token indices of the logits rows (samples, then every verification's), of the prompt
    positions scored and of the positions pooled (with each pool row's count)."""
    n, nd, nv = len(out.scheduled_seq_ids), out.num_decodes, out.num_verifies
    if plain and len(out.sample_seq_ids) == n:  # NOTE: the usual step: every decode samples
        sample_index = ends - 1
    else:
        at = {seq_id: i for i, seq_id in enumerate(out.scheduled_seq_ids)}
        sample = [int(ends[at[seq_id]]) - 1 for seq_id in out.sample_seq_ids]
        for i, drafts in zip(range(nd, nd + nv), out.spec_token_ids):
            sample.extend(range(int(ends[i]) - 1 - len(drafts), int(ends[i])))
        sample_index = np.array(sample, dtype=np.int64)
    if not out.prompt_logprobs and not out.pooled:
        return sample_index, None, None, None
    at = {seq_id: i for i, seq_id in enumerate(out.scheduled_seq_ids)}
    begins = ends - np.array(out.num_scheduled_tokens, dtype=np.int64)
    prompt_index = pool_index = pool_lens = None
    if out.prompt_logprobs:
        scored = [range(int(begins[at[s]]), int(begins[at[s]]) + count) for s, count in out.prompt_logprobs]
        prompt_index = np.array([i for r in scored for i in r], dtype=np.int64)
    if out.pooled:
        pooled = [range(int(begins[at[s]]) + first, int(begins[at[s]]) + first + num) for s, first, num in out.pooled]
        pool_index = np.array([i for r in pooled for i in r], dtype=np.int64)
        pool_lens = np.array([num for _, _, num in out.pooled], dtype=np.int64)
    return sample_index, prompt_index, pool_index, pool_lens
