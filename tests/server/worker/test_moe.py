"""The sparse mixture-of-experts block against transformers' Mixtral and Qwen3-MoE blocks on the
same weights (read back from ``save_pretrained`` checkpoints and from transformers' fused
layout), its grouping of tokens by expert, expert parallelism over two gloo ranks, half
precision, and the loading errors."""

from __future__ import annotations

import glob
import os
import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from pagedllm.server.config import ConfigError
from pagedllm.server.worker.model_loader import init_dummy_weights
from pagedllm.server.worker.models.moe import SparseMoeBlock
from pagedllm.server.worker.models.tensor_parallel import TPGroup

pytestmark = pytest.mark.timeout(300)
HIDDEN, INTER = 32, 48
CASES = [("mixtral", e, k, True) for e in (4, 8) for k in (1, 2)] + [
    ("qwen3_moe", e, k, norm) for e in (4, 8) for k in (1, 2) for norm in (True, False)
]
MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def hf_model(family: str, num_experts: int, top_k: int, norm_topk_prob: bool, seed: int = 0):
    """A one-layer random model whose MoE block routes decisively (router logits ~ N(0, 1))."""
    common = dict(
        vocab_size=64,
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=top_k,
        experts_implementation="eager",
    )
    if family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=INTER, num_local_experts=num_experts, **common))
    else:
        config = Qwen3MoeConfig(
            moe_intermediate_size=INTER,
            intermediate_size=2 * INTER,
            num_experts=num_experts,
            norm_topk_prob=norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
        model = Qwen3MoeForCausalLM(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, param.shape[-1] ** -0.5)
    return model.eval()


def hf_block(model) -> torch.nn.Module:
    return model.model.layers[0].mlp


def saved_block_tensors(model, path) -> dict[str, torch.Tensor]:
    """The block's tensors as a checkpoint on disk names them, relative to the block, in the
    canonical naming (Mixtral's ``w1``/``w3``/``w2`` renamed as a decoder would)."""
    model.save_pretrained(str(path))
    state: dict[str, torch.Tensor] = {}
    for file in glob.glob(os.path.join(str(path), "*.safetensors")):
        state.update(load_file(file))
    prefixes = ("model.layers.0.block_sparse_moe.", "model.layers.0.mlp.")
    tensors = {}
    for name, tensor in state.items():
        for prefix in prefixes:
            if name.startswith(prefix):
                tensors[canonical(name[len(prefix) :])] = tensor
    return tensors


def canonical(name: str) -> str:
    match = re.fullmatch(r"experts\.(\d+)\.(w[123])\.weight", name)
    return f"experts.{match[1]}.{MIXTRAL_PROJECTIONS[match[2]]}.weight" if match else name


def fused_block_tensors(model) -> dict[str, torch.Tensor]:
    """The block's tensors as transformers holds them in memory: all experts in one tensor."""
    return {name: t.detach().clone() for name, t in hf_block(model).state_dict().items()}


def make_block(num_experts: int, top_k: int, norm_topk_prob: bool, tp: TPGroup = TPGroup()) -> SparseMoeBlock:
    return SparseMoeBlock(HIDDEN, INTER, num_experts, top_k, norm_topk_prob, "silu", tp)


def loaded_block(tensors: dict[str, torch.Tensor], num_experts, top_k, norm, tp=TPGroup()) -> SparseMoeBlock:
    block = make_block(num_experts, top_k, norm, tp)
    for name, tensor in tensors.items():
        block.load_checkpoint_tensor(name, tensor)
    assert block.missing_checkpoint_tensors() == []
    return block


def hf_forward(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_block(model)(x[None]).reshape(x.shape)


# -- equality with transformers ----------------------------------------------------------------
@pytest.mark.parametrize("family,num_experts,top_k,norm", CASES)
def test_matches_transformers_on_a_saved_checkpoint(tmp_path, family, num_experts, top_k, norm):
    model = hf_model(family, num_experts, top_k, norm)
    tensors = saved_block_tensors(model, tmp_path)
    expected_names = {"gate.weight"} | {
        f"experts.{e}.{p}.weight" for e in range(num_experts) for p in ("gate_proj", "up_proj", "down_proj")
    }
    assert set(tensors) == expected_names
    block = loaded_block(tensors, num_experts, top_k, norm)
    x = torch.randn(37, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(block(x), hf_forward(model, x), atol=1e-5, rtol=1e-5)


def test_renormalisation_is_what_differs(tmp_path):
    """norm_topk_prob changes the output (so the cases above tell the two settings apart)."""
    model = hf_model("qwen3_moe", 8, 2, True)
    tensors = saved_block_tensors(model, tmp_path)
    x = torch.randn(9, HIDDEN)
    with torch.no_grad():
        normed = loaded_block(tensors, 8, 2, True)(x)
        raw = loaded_block(tensors, 8, 2, False)(x)
        weights, _ = loaded_block(tensors, 8, 2, False).route(x)
    assert not torch.allclose(normed, raw, atol=1e-3)
    assert (weights.sum(-1) < 1).all()


@pytest.mark.parametrize("family,num_experts,top_k,norm", [("mixtral", 8, 2, True), ("qwen3_moe", 4, 1, False)])
def test_loads_transformers_fused_layout(family, num_experts, top_k, norm):
    model = hf_model(family, num_experts, top_k, norm, seed=3)
    tensors = fused_block_tensors(model)
    assert set(tensors) == {"gate.weight", "experts.gate_up_proj", "experts.down_proj"}
    block = loaded_block(tensors, num_experts, top_k, norm)
    x = torch.randn(21, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(block(x), hf_forward(model, x), atol=1e-5, rtol=1e-5)


# -- routing edge cases and grouping -------------------------------------------------------------
def test_experts_that_get_no_tokens(tmp_path):
    model = hf_model("qwen3_moe", 8, 2, True)
    tensors = saved_block_tensors(model, tmp_path)
    gate = torch.randn(8, HIDDEN).abs()
    gate[2:] *= -1  # NOTE: x > 0 below, so experts 2..7 always score lowest
    tensors["gate.weight"] = gate
    with torch.no_grad():
        hf_block(model).gate.weight.copy_(gate)
    block = loaded_block(tensors, 8, 2, True)
    x = torch.randn(15, HIDDEN).abs()
    with torch.no_grad():
        _, experts = block.route(x)
        assert set(experts.flatten().tolist()) == {0, 1}
        torch.testing.assert_close(block(x), hf_forward(model, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens", [0, 1])
def test_zero_and_one_token(tmp_path, num_tokens):
    model = hf_model("mixtral", 4, 2, True)
    block = loaded_block(saved_block_tensors(model, tmp_path), 4, 2, True)
    x = torch.randn(num_tokens, HIDDEN)
    with torch.no_grad():
        out = block(x)
    assert out.shape == (num_tokens, HIDDEN)
    if num_tokens:
        torch.testing.assert_close(out, hf_forward(model, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_float32(tmp_path, dtype):
    model = hf_model("qwen3_moe", 8, 2, True)
    tensors = {n: t.to(dtype) for n, t in saved_block_tensors(model, tmp_path).items()}
    half = loaded_block(tensors, 8, 2, True).to(dtype)
    full = loaded_block(tensors, 8, 2, True)  # the same rounded weights, in float32
    x = torch.randn(33, HIDDEN).to(dtype)
    with torch.no_grad():
        out = half(x)
        weights, experts = half.route(x)
        expected = full.experts_forward(x.float(), weights, experts)
    assert out.dtype == dtype and weights.dtype == torch.float32
    # NOTE: the float32 twin uses the half block's routing, so near-ties cannot flip an expert
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_dummy_weights_fill_every_parameter_as_a_matrix():
    model = torch.nn.Module()
    model.mlp = make_block(4, 2, True)
    init_dummy_weights(model, seed=0)
    for name, param in model.named_parameters():
        assert 0.01 < param.std().item() < 0.03, name  # normal(0, 0.02), not a norm's ones
    assert torch.isfinite(model.mlp(torch.randn(5, HIDDEN))).all()


# -- loading errors and bookkeeping --------------------------------------------------------------
def test_missing_tensors_are_listed_until_loaded():
    block = make_block(2, 1, True)
    names = ["gate.weight"] + [f"experts.{e}.{p}.weight" for e in (0, 1) for p in ("gate_proj", "up_proj", "down_proj")]
    assert block.missing_checkpoint_tensors() == names
    block.load_checkpoint_tensor("experts.1.up_proj.weight", torch.randn(INTER, HIDDEN))
    block.load_checkpoint_tensor("experts.gate_up_proj", torch.randn(2, 2 * INTER, HIDDEN))
    assert block.missing_checkpoint_tensors() == [
        "gate.weight",
        "experts.0.down_proj.weight",
        "experts.1.down_proj.weight",
    ]


def test_per_expert_tensors_land_in_their_slots():
    block = make_block(4, 2, True)
    gate, up, down = torch.randn(INTER, HIDDEN), torch.randn(INTER, HIDDEN), torch.randn(HIDDEN, INTER)
    block.load_checkpoint_tensor("experts.2.gate_proj.weight", gate)
    block.load_checkpoint_tensor("experts.2.up_proj.weight", up)
    block.load_checkpoint_tensor("experts.2.down_proj.weight", down)
    assert torch.equal(block.w13[2], torch.cat([gate, up])) and torch.equal(block.w2[2], down)


@pytest.mark.parametrize(
    "name", ["experts.4.gate_proj.weight", "experts.0.w1.weight", "router.weight", "experts.0.gate_proj.bias"]
)
def test_unknown_tensor_is_refused_by_name(name):
    with pytest.raises(ValueError, match=re.escape(repr(name))):
        make_block(4, 2, True).load_checkpoint_tensor(name, torch.zeros(INTER, HIDDEN))


@pytest.mark.parametrize(
    "name,shape,expected",
    [
        ("gate.weight", (4, HIDDEN + 1), (4, HIDDEN)),
        ("experts.3.gate_proj.weight", (HIDDEN, INTER), (INTER, HIDDEN)),
        ("experts.0.down_proj.weight", (INTER, HIDDEN), (HIDDEN, INTER)),
        ("experts.gate_up_proj", (4, INTER, HIDDEN), (4, 2 * INTER, HIDDEN)),
        ("experts.down_proj", (2, HIDDEN, INTER), (4, HIDDEN, INTER)),
    ],
)
def test_wrong_shape_names_the_tensor_and_the_expected_shape(name, shape, expected):
    block = make_block(4, 2, True, TPGroup(rank=1, size=2))  # expert 0's tensors belong to rank 0: still checked
    with pytest.raises(ValueError, match=re.escape(f"{name!r} has shape {shape}, expected {expected}")):
        block.load_checkpoint_tensor(name, torch.zeros(shape))
    assert "gate.weight" in block.missing_checkpoint_tensors()


def test_a_rank_keeps_only_its_experts():
    block = make_block(4, 2, True, TPGroup(rank=1, size=2))
    assert block.w13.shape == (2, 2 * INTER, HIDDEN) and block.w2.shape == (2, HIDDEN, INTER)
    block.load_checkpoint_tensor("experts.0.down_proj.weight", torch.ones(HIDDEN, INTER))  # rank 0's: skipped
    block.load_checkpoint_tensor("experts.3.down_proj.weight", torch.full((HIDDEN, INTER), 3.0))
    down = torch.arange(4.0)[:, None, None].expand(4, HIDDEN, INTER)
    block.load_checkpoint_tensor("experts.down_proj", down)
    assert block.w2[:, 0, 0].tolist() == [2.0, 3.0]
    missing = block.missing_checkpoint_tensors()
    assert missing == ["gate.weight"] + [f"experts.{e}.{p}.weight" for e in (2, 3) for p in ("gate_proj", "up_proj")]


@pytest.mark.parametrize("num_experts,tp_size", [(6, 4), (8, 3)])
def test_experts_must_divide_among_ranks(num_experts, tp_size):
    with pytest.raises(ConfigError) as err:
        make_block(num_experts, 2, True, TPGroup(rank=0, size=tp_size))
    assert err.value.field == "tensor_parallel_size" and err.value.value == tp_size
    assert str(err.value) == (
        f"tensor_parallel_size={tp_size} is not allowed: a divisor of the model's {num_experts} experts"
    )


@pytest.mark.parametrize("top_k", [0, 5])
def test_top_k_must_be_between_one_and_the_experts(top_k):
    with pytest.raises(ValueError, match=f"num_experts_per_tok={top_k}"):
        make_block(4, top_k, True)


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="hidden_act='nope'"):
        SparseMoeBlock(HIDDEN, INTER, 4, 2, True, "nope")


# -- expert parallelism over two ranks ------------------------------------------------------------
def _rank_main(rank: int, size: int, store: str, inputs_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        inputs = torch.load(inputs_path)
        num_experts, top_k, norm = inputs["config"]
        tp = TPGroup(rank=rank, size=size)
        result = {}
        for layout in ("saved", "fused"):
            block = loaded_block(inputs[layout], num_experts, top_k, norm, tp)
            with torch.no_grad():
                result[layout] = [block(x) for x in inputs["xs"]]
            result["first_expert"], result["local_experts"] = block.first_expert, block.w13.shape[0]
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("num_experts,top_k,norm", [(4, 2, True), (8, 1, False)])
def test_two_ranks_match_one(tmp_path, monkeypatch, num_experts, top_k, norm):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    model = hf_model("qwen3_moe", num_experts, top_k, norm, seed=7)
    saved = saved_block_tensors(model, tmp_path / "ckpt")
    xs = [torch.randn(n, HIDDEN) for n in (29, 1, 0)]
    inputs_path = str(tmp_path / "inputs.pt")
    torch.save(
        {"config": (num_experts, top_k, norm), "saved": saved, "fused": fused_block_tensors(model), "xs": xs},
        inputs_path,
    )
    args = (2, str(tmp_path / "store"), inputs_path, str(tmp_path))
    torch.multiprocessing.start_processes(_rank_main, args=args, nprocs=2, start_method="spawn")
    single = loaded_block(saved, num_experts, top_k, norm)
    with torch.no_grad():
        expected = [single(x) for x in xs]
    for rank in range(2):
        result = torch.load(str(tmp_path / f"rank{rank}.pt"))
        assert (result["first_expert"], result["local_experts"]) == (rank * num_experts // 2, num_experts // 2)
        for layout in ("saved", "fused"):
            for out, ref in zip(result[layout], expected):
                torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
