"""Greedy choice is torch's argmax exactly, however it is computed."""

from __future__ import annotations

import torch

from pagedllm.server.worker.greedy import greedy_ids


def test_greedy_ids_are_torch_argmax_with_ties_infinities_and_nan():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randint(-3, 3, (9, 40), generator=g).float()  # NOTE: many ties: the first index wins
        mask = torch.rand(9, 40, generator=g)
        logits[mask < 0.05] = float("nan")
        logits[(mask > 0.05) & (mask < 0.1)] = float("inf")
        logits[2], logits[3] = float("-inf"), float("nan")
        for view in (logits, logits[::2], logits[:, 7:]):  # NOTE: strided views as the sampler's index gives
            with torch.inference_mode():
                ids = greedy_ids(view)
            assert ids.dtype == torch.int64 and torch.equal(ids, view.argmax(dim=-1))
    half = logits.nan_to_num().half()
    assert torch.equal(greedy_ids(half), half.argmax(dim=-1))  # other dtypes: torch's own
