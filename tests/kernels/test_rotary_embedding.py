"""rotary_embedding: the Triton kernel (in place on q and k) against a float64 pair-by-pair
oracle, and the reference against kernels.rotary_cpu's, for both layouts."""

import math

import pytest
import torch
from kernel_factories import DEVICE, gpu_test

from pagedllm.kernels.rotary_cpu import rotary_reference
from pagedllm.kernels.rotary_embedding import rotary_embedding, rotary_embedding_reference
from pagedllm.server.worker.models.rope import rotation_table

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}
PARAMS = {"rope_type": "default", "rope_theta": 10000.0}


def _oracle(x, positions, cos, sin, head_dim, is_neox):
    """float64 rotation, one pair at a time: pair i turns by the table's column i."""
    out = x.cpu().double().reshape(x.shape[0], -1, head_dim).clone()
    half = cos.shape[-1] // 2
    for i in range(half):
        c, s = cos[positions.cpu(), i].double()[:, None], sin[positions.cpu(), i].double()[:, None]
        a, b = (i, i + half) if is_neox else (2 * i, 2 * i + 1)
        xa, xb = out[..., a].clone(), out[..., b].clone()
        out[..., a], out[..., b] = xa * c - xb * s, xb * c + xa * s
    return out.reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("tokens,q_heads,k_heads,head_dim,partial", [(1, 4, 4, 16, None), (9, 8, 2, 64, None),
                                                                      (5, 3, 1, 32, 0.5)])  # fmt: skip
def test_kernel_matches_oracle_in_place(seed, dtype, is_neox, tokens, q_heads, k_heads, head_dim, partial):
    params = dict(PARAMS, partial_rotary_factor=partial) if partial else PARAMS
    cos, sin = rotation_table(head_dim, 256, params)
    # q and k as neighbouring column slices of one fused q/k/v output
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * head_dim).to(dtype).to(DEVICE)
    q, k = qkv[:, : q_heads * head_dim], qkv[:, q_heads * head_dim : (q_heads + k_heads) * head_dim]
    v_before = qkv[:, (q_heads + k_heads) * head_dim :].clone()
    positions = torch.randint(0, 256, (tokens,)).to(DEVICE)
    want_q = _oracle(q, positions, cos, sin, head_dim, is_neox)
    want_k = _oracle(k, positions, cos, sin, head_dim, is_neox)
    got_q, got_k = rotary_embedding(positions, q, k, cos.to(DEVICE), sin.to(DEVICE), head_dim, is_neox)
    assert got_q is q and got_k is k
    tol = TOL[dtype]
    torch.testing.assert_close(q.cpu().double(), want_q, **tol, msg=lambda e: f"seed={seed}: {e}")
    torch.testing.assert_close(k.cpu().double(), want_k, **tol, msg=lambda e: f"seed={seed}: {e}")
    assert torch.equal(qkv[:, (q_heads + k_heads) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("is_neox", [True, False])
def test_reference_matches_oracle(seed, is_neox):
    cos, sin = rotation_table(32, 64, PARAMS)
    x, positions = torch.randn(6, 3 * 32), torch.randint(0, 64, (6,))
    got = rotary_embedding_reference(positions, x, cos, sin, 32, is_neox).double()
    torch.testing.assert_close(got, _oracle(x, positions, cos, sin, 32, is_neox), atol=1e-5, rtol=1e-5)


def test_neox_reference_is_the_cpu_reference(seed):
    cos, sin = rotation_table(64, 128, dict(PARAMS, partial_rotary_factor=0.25))
    x, positions = torch.randn(7, 2 * 64).half(), torch.randint(0, 128, (7,))
    assert torch.equal(
        rotary_embedding_reference(positions, x, cos, sin, 64), rotary_reference(x, cos, sin, positions, 64)
    )


def test_position_zero_is_identity():
    cos, sin = rotation_table(16, 8, PARAMS)
    q, k = torch.randn(2, 32).to(DEVICE), torch.randn(2, 16).to(DEVICE)
    q0, k0 = q.clone(), k.clone()
    rotary_embedding(torch.zeros(2, dtype=torch.int64).to(DEVICE), q, k, cos.to(DEVICE), sin.to(DEVICE), 16)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    assert math.isclose(float(cos[0, 0]), 1.0)


def test_launcher_rejects_bad_arguments():
    cos, sin = rotation_table(16, 8, PARAMS)
    q = torch.randn(2, 32)
    with pytest.raises(ValueError, match="heads \\* head_dim"):
        rotary_embedding(torch.zeros(2, dtype=torch.int64), q, torch.randn(2, 15), cos, sin, 16)
    with pytest.raises(ValueError, match="positions must be int"):
        rotary_embedding(torch.zeros(2), q, q.clone(), cos, sin, 16)
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary_embedding(torch.zeros(2, dtype=torch.int64), q, q.clone(), cos, sin, 8)


@pytest.mark.parametrize("is_neox", [True, False])
@gpu_test
def test_bf16_on_gpu_matches_reference(seed, is_neox):
    cos, sin = (t.cuda() for t in rotation_table(128, 4096, PARAMS))
    q, k = torch.randn(300, 32 * 128, device="cuda").bfloat16(), torch.randn(300, 8 * 128, device="cuda").bfloat16()
    positions = torch.randint(0, 4096, (300,), device="cuda")
    want_q = rotary_embedding_reference(positions, q, cos, sin, 128, is_neox)
    want_k = rotary_embedding_reference(positions, k, cos, sin, 128, is_neox)
    rotary_embedding(positions, q, k, cos, sin, 128, is_neox)
    torch.testing.assert_close(q.float(), want_q.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k.float(), want_k.float(), atol=2e-2, rtol=2e-2)
