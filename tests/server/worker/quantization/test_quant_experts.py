"""A MoE block whose experts stay quantized against the plain block on their dequantized weights."""

from __future__ import annotations

import re

import pytest
import torch
from quant_writers import awq_tensors, fp8_block_tensors, gptq_tensors

from pagedllm.server.config.quantization import QuantConfig
from pagedllm.server.worker.models.moe import SparseMoeBlock
from pagedllm.server.worker.models.tensor_parallel import TPGroup
from pagedllm.server.worker.quantization.linear import QuantLinear, finish_quantized_layers

HIDDEN, INTER, EXPERTS, TOP_K = 64, 128, 4, 2
SHAPES = {"gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}
CONFIGS = {
    "awq": (QuantConfig("awq", "awq", 4, 32, sym=False), lambda w: awq_tensors(w, 32)),
    "gptq-act-order": (
        QuantConfig("gptq", "gptq", 4, 32, sym=False, desc_act=True, zeros_minus_one=True),
        lambda w: gptq_tensors(w, 4, 32, False, True, seed=1),
    ),
    "fp8-block": (QuantConfig("fp8", "fp8-block", 8, 32, block=(32, 32)), lambda w: fp8_block_tensors(w, 32)),
}


def checkpoints(fmt: str, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(quantized tensors, the dequantized twin's plain tensors) of a block, named as the block loads them."""
    gen = torch.Generator().manual_seed(seed)
    quantize = CONFIGS[fmt][1]
    router = torch.randn(EXPERTS, HIDDEN, generator=gen)
    quantized, plain = {"gate.weight": router}, {"gate.weight": router}
    for e in range(EXPERTS):
        for proj, shape in (
            ("gate_proj", (INTER, HIDDEN)),
            ("up_proj", (INTER, HIDDEN)),
            ("down_proj", (HIDDEN, INTER)),
        ):
            tensors, twin = quantize(torch.randn(*shape, generator=gen) * 0.1)
            quantized.update({f"experts.{e}.{proj}.{k}": v.contiguous() for k, v in tensors.items()})
            plain[f"experts.{e}.{proj}.weight"] = twin
    return quantized, plain


def block(cfg: QuantConfig | None, tensors: dict[str, torch.Tensor], tp: TPGroup = TPGroup()) -> SparseMoeBlock:
    moe = SparseMoeBlock(HIDDEN, INTER, EXPERTS, TOP_K, True, "silu", tp, quant=cfg)
    for name, tensor in tensors.items():
        moe.load_checkpoint_tensor(name, tensor)
    assert moe.missing_checkpoint_tensors() == []
    finish_quantized_layers(moe, torch.device("cpu"), torch.float32)
    return moe


@pytest.mark.parametrize("fmt", sorted(CONFIGS))
@pytest.mark.parametrize("tokens", [0, 1, 9])
def test_quantized_experts_match_the_plain_block_on_the_twin(fmt, tokens):
    quantized, plain = checkpoints(fmt)
    cfg = CONFIGS[fmt][0]
    q_block, p_block = block(cfg, quantized), block(None, plain)
    assert q_block.quantized is not None and not hasattr(q_block, "w13")
    x = torch.randn(tokens, HIDDEN)
    torch.testing.assert_close(q_block(x), p_block(x), atol=1e-5, rtol=1e-5)


def test_a_rank_keeps_and_runs_only_its_experts():
    quantized, plain = checkpoints("awq", seed=1)
    cfg = CONFIGS["awq"][0]
    ranks = [block(cfg, quantized, TPGroup(rank=r, size=2)) for r in (0, 1)]
    assert [len(r.quantized.experts) for r in ranks] == [2, 2]  # type: ignore[union-attr]
    x = torch.randn(7, HIDDEN)
    weights, experts = ranks[0].route(x)
    summed = sum(r.experts_forward(x, weights, experts) for r in ranks)
    torch.testing.assert_close(summed, block(None, plain)(x), atol=1e-5, rtol=1e-5)


def test_quantized_tensors_are_listed_until_loaded_and_checked_by_name_and_shape():
    cfg = CONFIGS["awq"][0]
    moe = SparseMoeBlock(HIDDEN, INTER, EXPERTS, TOP_K, True, "silu", TPGroup(rank=1, size=2), quant=cfg)
    missing = moe.missing_checkpoint_tensors()
    assert missing[:4] == [
        "gate.weight",
        "experts.2.gate_proj.qweight",
        "experts.2.gate_proj.qzeros",
        "experts.2.gate_proj.scales",
    ]
    assert len(missing) == 1 + 2 * 3 * 3
    with pytest.raises(ValueError, match=re.escape("'experts.0.up_proj.weight' is not part of a quantized expert")):
        moe.load_checkpoint_tensor("experts.0.up_proj.weight", torch.zeros(INTER, HIDDEN))
    with pytest.raises(ValueError, match=re.escape("'experts.0.down_proj.scales' has shape (1, 1), expected (4, 64)")):
        moe.load_checkpoint_tensor("experts.0.down_proj.scales", torch.zeros(1, 1))  # rank 0's: still checked
    with pytest.raises(ValueError, match=re.escape("'experts.0.gate_proj.weight' is not part of a quantized expert")):
        moe.load_checkpoint_tensor("experts.gate_up_proj", torch.zeros(EXPERTS, 2 * INTER, HIDDEN))
    assert all(isinstance(m, QuantLinear) for m in moe.quantized.experts[0].children())  # type: ignore[union-attr]
