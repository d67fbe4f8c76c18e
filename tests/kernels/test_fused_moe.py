"""fused_moe: the Triton grouped matmul against its torch reference, the reference against a
per-token loop, the tiling plan, and the launcher's checks."""

import importlib

import pytest
import torch
from kernel_factories import DEVICE, assert_close, gpu_test

from pagedllm.kernels import fused_moe, fused_moe_reference
from pagedllm.kernels.fused_moe import tile_plan

fused_moe_module = importlib.import_module("pagedllm.kernels.fused_moe")  # NOTE: the package's name is the function

silu = torch.nn.functional.silu


def _random_case(tokens, hidden, inter, num_experts, top_k, dtype, device=DEVICE, foreign=0.0):
    """Random weights and routing; a fraction ``foreign`` of the pairs go to other ranks' experts."""
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=device) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device=device) * inter**-0.5).to(dtype)
    experts = torch.rand(tokens, num_experts, device=device).argsort(dim=1)[:, :top_k]  # distinct per token
    away = torch.rand(tokens, top_k, device=device) < foreign
    experts = torch.where(away, experts + num_experts * torch.where(experts % 2 == 0, 1, -2), experts)
    weights = torch.rand(tokens, top_k, device=device)
    return x, w13, w2, weights, experts


def _per_token(x, w13, w2, weights, experts, act):
    """The definition, one token and one slot at a time (float32)."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            if 0 <= e < w13.shape[0]:
                h = w13[e].float() @ x[t].float()
                out[t] += weights[t, j] * (w2[e].float() @ (act(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize(
    "tokens,hidden,inter,num_experts,top_k", [(37, 32, 48, 8, 2), (5, 24, 20, 4, 1), (1, 16, 16, 3, 3)]
)
@pytest.mark.parametrize("foreign", [0.0, 0.4])
def test_reference_matches_per_token_loop(seed, tokens, hidden, inter, num_experts, top_k, foreign):
    case = _random_case(tokens, hidden, inter, num_experts, top_k, torch.float32, device="cpu", foreign=foreign)
    torch.testing.assert_close(fused_moe_reference(*case, silu), _per_token(*case, silu), atol=1e-5, rtol=1e-5)


def test_reference_runs_one_matmul_pair_per_used_expert(monkeypatch, seed):
    x, w13, w2, weights, experts = _random_case(40, 16, 24, 8, 2, torch.float32, device="cpu")
    experts[experts == 5] = 6  # NOTE: expert 5 gets no rows and must not run
    calls: list[tuple[int, int]] = []
    real_linear = fused_moe_module.linear

    def counting(rows, weight):
        calls.append((rows.shape[0], weight.data_ptr()))
        return real_linear(rows, weight)

    monkeypatch.setattr(fused_moe_module, "linear", counting)
    fused_moe_reference(x, w13, w2, weights, experts, silu)
    counts = torch.bincount(experts.flatten(), minlength=8).tolist()
    expected = []
    for e, n in enumerate(counts):
        if n:
            expected += [(n, w13[e].data_ptr()), (n, w2[e].data_ptr())]
    assert calls == expected


def test_tile_plan_pads_each_expert_to_whole_tiles():
    experts = torch.tensor([[0, 3], [0, 1], [3, 0]])  # pairs 0..5
    sorted_pairs, tile_expert = tile_plan(experts, 4, block_m=4)
    pad = 6
    assert sorted_pairs.tolist() == [0, 2, 5, pad, 3, pad, pad, pad, 1, 4, pad, pad] + [pad] * 12
    assert tile_expert.tolist() == [0, 1, 3, -1, -1, -1]


def test_tile_plan_leaves_out_other_ranks_pairs():
    experts = torch.tensor([[-1, 1], [2, 0], [1, 5]])  # local experts 0, 1; -1, 2, 5 are other ranks'
    sorted_pairs, tile_expert = tile_plan(experts, 2, block_m=2)
    pad = 6
    assert sorted_pairs.tolist() == [3, pad, 1, 4, pad, pad, pad, pad, pad, pad]
    assert tile_expert.tolist() == [0, 1, -1, -1, -1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "tokens,hidden,inter,num_experts,top_k",
    [
        (37, 32, 48, 8, 2),
        (19, 24, 20, 4, 1),
        (1, 16, 16, 3, 3),
        (0, 16, 16, 4, 2),
        (70, 40, 24, 2, 2),
        (9, 96, 72, 4, 2),
    ],
)
def test_kernel_matches_reference(seed, dtype, tokens, hidden, inter, num_experts, top_k):
    case = _random_case(tokens, hidden, inter, num_experts, top_k, dtype, foreign=0.3)
    out = fused_moe(*case, silu)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    assert_close(out, fused_moe_reference(*case, silu), seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@gpu_test
def test_kernel_matches_reference_cuda(seed, dtype):
    case = _random_case(300, 256, 384, 16, 4, dtype, device="cuda", foreign=0.5)
    assert_close(fused_moe(*case, silu), fused_moe_reference(*case, silu), seed)


def test_launcher_checks_shapes_and_dtypes():
    x, w13, w2, weights, experts = _random_case(4, 16, 8, 2, 1, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x, w13, w2[:, :, :4], weights, experts, silu)
    with pytest.raises(ValueError, match="float32"):
        fused_moe(x, w13, w2, weights.half(), experts, silu)
    with pytest.raises(ValueError, match=r"\[tokens, top_k\] for 4 tokens"):
        fused_moe(x, w13, w2, weights[:3], experts[:3], silu)
