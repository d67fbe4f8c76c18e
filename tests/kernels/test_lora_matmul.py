"""lora_shrink / lora_expand: the Triton kernels against the grouped torch references, the
references against a per-token loop, and the segment plan."""

import pytest
import torch
from kernel_factories import DEVICE, assert_close

from pagedllm.kernels import lora_expand, lora_expand_reference, lora_shrink, lora_shrink_reference
from pagedllm.kernels.lora_matmul import plan_slots


def _case(tokens, k, n, slots, rank, device=DEVICE, dtype=torch.float32):
    x = torch.randn(tokens, k, device=device).to(dtype)
    a = torch.randn(slots, rank, k, device=device).to(dtype)
    b = torch.randn(slots, n, rank, device=device).to(dtype)
    a[0], b[0] = 0, 0  # NOTE: slot 0 is the base model's and holds zeros
    token_slots = torch.randint(0, slots, (tokens,), device=device)
    return x, a, b, token_slots


def _per_token(x, a, b, token_slots):
    out = torch.zeros(x.shape[0], b.shape[1])
    for t in range(x.shape[0]):
        s = int(token_slots[t])
        out[t] = b[s].float() @ (a[s].float() @ x[t].float())
    return out


@pytest.mark.parametrize("tokens,k,n,slots,rank", [(23, 48, 40, 4, 8), (1, 16, 16, 2, 16), (9, 64, 200, 5, 64)])
def test_references_match_per_token_loop(seed, tokens, k, n, slots, rank):
    x, a, b, token_slots = _case(tokens, k, n, slots, rank, device="cpu")
    y = torch.randn(tokens, n)
    want = y + _per_token(x, a, b, token_slots)
    xa = lora_shrink_reference(x, a, token_slots)
    lora_expand_reference(y, xa, b, token_slots)
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tokens,k,n,slots,rank", [(23, 48, 40, 4, 8), (1, 16, 16, 2, 16), (9, 64, 200, 5, 64)])
def test_triton_matches_reference(seed, tokens, k, n, slots, rank):
    x, a, b, token_slots = _case(tokens, k, n, slots, rank)
    xa = lora_shrink(x, a, token_slots)
    assert_close(xa, lora_shrink_reference(x, a, token_slots), seed)
    y = torch.randn(tokens, n, device=DEVICE)
    want = y.clone()
    lora_expand_reference(want, xa, b, token_slots)
    lora_expand(y, xa, b, token_slots)
    assert_close(y, want, seed)


def test_slot_zero_rows_are_left_alone(seed):
    x, a, b, token_slots = _case(6, 16, 16, 3, 8)
    a[0], b[0] = 1.0, 1.0  # NOTE: even if slot 0 held something, its tokens are skipped
    token_slots[:] = torch.tensor([0, 1, 0, 2, 0, 0])
    y = torch.randn(6, 16, device=DEVICE)
    before = y.clone()
    lora_expand(y, lora_shrink(x, a, token_slots), b, token_slots)
    assert torch.equal(y[token_slots == 0], before[token_slots == 0])
    assert not torch.equal(y[1], before[1])


def test_plan_groups_tokens_by_slot():
    plan = plan_slots(torch.tensor([2, 2, 0, 1, 1, 1, 2]), ranks=[0, 4, 8])
    assert plan.order.tolist() == [3, 4, 5, 0, 1, 6]
    assert [(s.slot, s.rows, s.rank) for s in plan.segments] == [(1, slice(0, 3), 4), (2, slice(3, 6), 8)]


def test_plan_of_grouped_tokens_slices_them_in_place():
    plan = plan_slots(torch.tensor([0, 0, 1, 1, 3, 3, 3, 0]))
    assert plan.order is None
    assert [(s.slot, s.rows) for s in plan.segments] == [(1, slice(2, 4)), (3, slice(4, 7))]
    assert plan_slots(torch.tensor([0, 0])).segments == []


@pytest.mark.parametrize("slots", [[0, 1, 1, 2, 2, 0], [2, 1, 0, 2, 1, 1], [0, 0, 0, 0, 0, 0]])
def test_grouped_and_scattered_plans_match_per_token_loop(slots):
    x, a, b, _ = _case(6, 16, 12, 3, 4, device="cpu")
    token_slots = torch.tensor(slots)
    y = torch.zeros(6, 12)
    lora_expand_reference(y, lora_shrink_reference(x, a, token_slots), b, token_slots)
    torch.testing.assert_close(y, _per_token(x, a, b, token_slots), atol=1e-4, rtol=1e-4)


def test_reference_uses_only_each_slots_rank():
    """Columns past a slot's rank are never read: garbage there changes nothing."""
    x, a, b, token_slots = _case(10, 16, 12, 3, 8, device="cpu")
    plan = plan_slots(token_slots, ranks=[0, 4, 8])
    a[1, 4:], b[1, :, 4:] = 0, 0
    y = torch.zeros(10, 12)
    lora_expand_reference(y, lora_shrink_reference(x, a, token_slots, plan), b, token_slots, plan)
    a[1, 4:], b[1, :, 4:] = 1e6, 1e6
    again = torch.zeros(10, 12)
    lora_expand_reference(again, lora_shrink_reference(x, a, token_slots, plan), b, token_slots, plan)
    torch.testing.assert_close(again, y)


def test_shapes_are_checked():
    x, a, b, token_slots = _case(4, 16, 8, 2, 4, device="cpu")
    with pytest.raises(ValueError, match="token_slots must be int64"):
        lora_shrink_reference(x, a, token_slots.int())
    with pytest.raises(ValueError, match="expected x"):
        lora_shrink_reference(x[0], a, token_slots)
