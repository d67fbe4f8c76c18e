"""Which proposed tokens the target model accepts, so that the output follows its own distribution.

For proposals ``d_0 .. d_{k-1}`` and the target's distributions ``p_0 .. p_k`` (``p_i`` is
the next-token distribution after ``d_{i-1}``, ``p_0`` after the sequence's newest token):

* greedy: ``d_i`` is accepted while it is the argmax of ``p_i``; the first argmax that
  differs is emitted instead, and if every proposal is accepted the argmax of ``p_k``
  follows. Exactly the tokens greedy decoding without proposals produces.
* sampled, from a draft distribution ``q_i``: ``d_i`` is accepted with probability
  ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection a token is drawn from
  ``norm(max(p_i - q_i, 0))`` and the rest is dropped; all accepted, one more is drawn
  from ``p_k`` (Leviathan et al. 2023, Chen et al. 2023). Each emitted token is then
  distributed as ``p_i``.
* sampled, one-hot draft (n-gram proposals, ``q_i = [d_i]``): acceptance is ``p_i(d_i)``
  and the residual is ``p_i`` without ``d_i``. Drawing ``x ~ p_i`` and accepting when
  ``x == d_i`` (else emitting ``x``) is that same rule, and uses one draw per emitted
  token exactly as sampling without proposals does: a seeded request gets the tokens it
  would get without speculation.
"""

from __future__ import annotations

import torch


def greedy_accept(best: list[int], drafts: list[int]) -> list[int]:
    """Emitted tokens for greedy decoding; ``best``: the argmax at each of the ``len(drafts) + 1`` positions."""
    out = []
    for target, draft in zip(best, drafts):
        out.append(target)
        if target != draft:
            return out
    out.append(best[len(drafts)])
    return out


def sample_accept(
    probs: torch.Tensor,
    drafts: list[int],
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """Emitted tokens for sampling; ``probs``: [len(drafts) + 1, vocab] the target's (filtered) distributions.

    ``draft_probs``: [len(drafts), vocab] the distributions the drafts were drawn from; None: one-hot.
    """
    out = []
    for i, draft in enumerate(drafts):
        if draft_probs is None:
            token = _draw(probs[i], generator)
            out.append(token)
            if token != draft:
                return out
            continue
        p, q = probs[i], draft_probs[i]
        # NOTE: u < p/q without dividing; q[draft] > 0 as the draft was drawn from q.
        if float(torch.rand((), generator=generator, device=generator.device)) * float(q[draft]) < float(p[draft]):
            out.append(draft)
            continue
        out.append(_draw(_residual(p, q), generator))
        return out
    out.append(_draw(probs[len(drafts)], generator))
    return out


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(p - q, 0))``; ``p`` itself where that is empty (p == q: a rejection then has probability 0)."""
    residual = (p - q).clamp(min=0.0)
    total = float(residual.sum())
    return residual / total if total > 0.0 else p


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    # NOTE: the same call the sampler makes for one sample of one row (same generator use).
    return int(torch.multinomial(probs, 1, replacement=True, generator=generator))
