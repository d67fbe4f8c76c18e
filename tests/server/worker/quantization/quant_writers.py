"""Tiny quantized checkpoints in each public format, written from a random LLaMA, with their twins.

Every projection of a random tiny LLaMA is quantized here (independently of the engine's
code: own packing, own group arithmetic) and stored in the format's layout with its
``quantization_config``. The *twin* is the same model with each projection replaced by its
dequantized weight, saved plainly: transformers runs it as the oracle.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from pagedllm.kernels import bf16_gemm_cpu
from pagedllm.server.demo import build_byte_tokenizer, demo_llama_config

F32_KERNEL = "f32-tiles" if bf16_gemm_cpu.f32_available() else "onednn-packed"
"""What multiplies a float32 linear weight on this CPU (the banner's and metrics' name for it)."""

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def quantize(w: torch.Tensor, bits: int, g_idx: torch.Tensor, groups: int, sym: bool):
    """w [N, K] -> (q [N, K] unsigned levels, scales [N, groups] fp16, zeros [N, groups] levels)."""
    top = (1 << bits) - 1
    n = w.shape[0]
    scales, zeros = torch.empty(n, groups, dtype=torch.float16), torch.empty(n, groups)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            s = cols.abs().amax(1) / (top // 2)
            z = torch.full((n,), float(1 << (bits - 1)))
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = (hi - lo) / top
            z = torch.round(-lo / s).clamp(0, top)
        scales[:, g], zeros[:, g] = s.clamp(min=1e-6).half(), z
    s_full, z_full = scales.float()[:, g_idx], zeros[:, g_idx]
    q = torch.round(w / s_full + z_full).clamp(0, top)
    return q.to(torch.uint8), scales, zeros


def dequantized(q, scales, zeros, g_idx) -> torch.Tensor:
    return (q.float() - zeros[:, g_idx]) * scales.float()[:, g_idx]


def to_int32(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.int64) & 0xFFFFFFFF
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def pack_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] unsigned -> int32 [R * bits / 32, C], sequential along rows (GPTQ's qweight)."""
    per = 32 // bits
    v = v.to(torch.int64).reshape(-1, per, v.shape[1])
    return to_int32(sum(v[:, i] << (bits * i) for i in range(per)))


def awq_tensors(w, group):
    n, k = w.shape
    g_idx = torch.arange(k) // group
    q, s, z = quantize(w, 4, g_idx, k // group, sym=False)

    def pack(v):  # [rows, N] -> [rows, N / 8] in AWQ's order
        v = v.to(torch.int64)
        return to_int32(sum(v[:, AWQ_ORDER[i] :: 8] << (4 * i) for i in range(8)))

    t = {"qweight": pack(q.T), "qzeros": pack(z.T), "scales": s.T.contiguous()}
    return t, dequantized(q, s, z, g_idx)


def gptq_tensors(w, bits, group, sym, desc_act, seed):
    n, k = w.shape
    g = group if group > 0 else k
    if desc_act:
        order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.long)
        g_idx[order] = torch.arange(k) // g
    else:
        g_idx = torch.arange(k) // g
    q, s, z = quantize(w, bits, g_idx, k // g, sym)
    zeros_v1 = (z.to(torch.int64) - 1) & ((1 << bits) - 1)
    t = {
        "qweight": pack_rows(q.T, bits),
        "qzeros": _pack_cols(zeros_v1.T.contiguous(), bits),
        "scales": s.T.contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }
    return t, dequantized(q, s, z, g_idx)


def _pack_cols(v, bits):
    """[R, C] -> int32 [R, C * bits / 32], sequential along columns (GPTQ's qzeros)."""
    return pack_rows(v.T.contiguous(), bits).T.contiguous()


def ct_pack_tensors(w, bits, group, sym):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    n, k = w.shape
    g = group if group > 0 else k
    g_idx = torch.arange(k) // g
    q, s, z = quantize(w, bits, g_idx, k // g, sym)
    mid = 1 << (bits - 1)
    t = {
        "weight_packed": pack_to_int32((q.int() - mid).to(torch.int8), bits),
        "weight_scale": s,
        "weight_shape": torch.tensor([n, k]),
    }
    if not sym:
        t["weight_zero_point"] = pack_to_int32((z.int() - mid).to(torch.int8), bits, packed_dim=0)
    return t, dequantized(q, s, z, g_idx)


def channel_tensors(w, kind):
    """int8 or fp8 e4m3 per output channel (compressed-tensors W8A8)."""
    top = 127.0 if kind == "int8" else 448.0
    s = (w.abs().amax(1, keepdim=True) / top).float()
    q = torch.round(w / s).clamp(-127, 127).to(torch.int8) if kind == "int8" else (w / s).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": s}, q.float() * s


def fp8_block_tensors(w, block=32):
    n, k = w.shape
    blocks = w.reshape(n // block, block, k // block, block)
    s = blocks.abs().amax(dim=(1, 3)) / 448.0
    s_full = s.repeat_interleave(block, 0).repeat_interleave(block, 1)
    q = (w / s_full).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": s}, q.float() * s_full


def tiny_model(family: str):
    """A random tiny LLaMA, Qwen2 (q/k/v bias, tied embeddings) or Mixtral (4 experts, stacked expert tensors)."""
    if family in ("mixtral", "qwen2"):
        from family_factories import family_config
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(family_config(family))
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(demo_llama_config(**SHAPE, initializer_range=0.2))


def _expert_weights(name: str, tensor: torch.Tensor):
    """transformers' stacked experts as the per-expert [N, K] weights checkpoints name one by one."""
    prefix = name.rsplit(".", 1)[0]
    for e in range(tensor.shape[0]):
        if name.endswith("gate_up_proj"):
            gate, up = tensor[e].chunk(2)
            yield f"{prefix}.{e}.gate_proj", gate
            yield f"{prefix}.{e}.up_proj", up
        else:
            yield f"{prefix}.{e}.down_proj", tensor[e]


def write_quantized(root: str, fmt: str, seed: int = 0, family: str = "llama", **options) -> tuple[str, str]:
    """(quantized checkpoint dir, dequantized twin dir) of a random tiny model in ``fmt``."""
    torch.manual_seed(seed)
    model = tiny_model(family)
    quantized, plain = {}, {}
    for name, tensor in model.state_dict().items():
        parts = name.rsplit(".", 2)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            twins = []
            for expert, weight in _expert_weights(name, tensor):
                tensors, twin = TENSORS[fmt](weight.float(), seed=seed, **options)
                quantized.update({f"{expert}.{k}": v.contiguous() for k, v in tensors.items()})
                twins.append(twin)
            per = len(twins) // tensor.shape[0]
            plain[name] = torch.stack([torch.cat(twins[i : i + per]) for i in range(0, len(twins), per)])
        elif len(parts) == 3 and parts[1] in PROJECTIONS and parts[2] == "weight":
            tensors, twin = TENSORS[fmt](tensor.float(), seed=seed, **options)
            quantized.update({f"{parts[0]}.{parts[1]}.{k}": v.contiguous() for k, v in tensors.items()})
            plain[name] = twin
        else:
            quantized[name] = plain[name] = tensor.clone()
    qdir, tdir = os.path.join(root, f"{fmt}-q"), os.path.join(root, f"{fmt}-twin")
    model.load_state_dict(plain)
    model.save_pretrained(tdir, safe_serialization=True)
    build_byte_tokenizer().save_pretrained(tdir)
    os.makedirs(qdir, exist_ok=True)
    save_file(quantized, os.path.join(qdir, "model.safetensors"))
    config = json.load(open(os.path.join(tdir, "config.json")))
    config["quantization_config"] = CONFIGS[fmt](**options)
    json.dump(config, open(os.path.join(qdir, "config.json"), "w"))
    build_byte_tokenizer().save_pretrained(qdir)
    return qdir, tdir


def _ct_config(fmt, weights, acts=None):
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
        "ignore": ["lm_head"],
    }


def _ct_pack_config(bits=4, group=32, sym=True):
    strategy = "group" if group > 0 else "channel"
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy, "group_size": group}
    return _ct_config("pack-quantized", weights)


def _ct_channel_config(kind):
    weights = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "channel"}
    acts = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "token", "dynamic": True}
    return _ct_config("int-quantized" if kind == "int" else "float-quantized", weights, acts)


TENSORS = {
    "awq": lambda w, seed, group=32: awq_tensors(w, group),
    "gptq": lambda w, seed, bits=4, group=32, sym=True, desc_act=False: gptq_tensors(
        w, bits, group, sym, desc_act, seed
    ),
    "ct-pack": lambda w, seed, bits=4, group=32, sym=True: ct_pack_tensors(w, bits, group, sym),
    "ct-int8": lambda w, seed: channel_tensors(w, "int8"),
    "ct-fp8": lambda w, seed: channel_tensors(w, "fp8"),
    "fp8-block": lambda w, seed: fp8_block_tensors(w),
}
CONFIGS = {
    "awq": lambda group=32: {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
    },
    "gptq": lambda bits=4, group=32, sym=True, desc_act=False: {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group,
        "sym": sym,
        "desc_act": desc_act,
        "checkpoint_format": "gptq",
    },
    "ct-pack": _ct_pack_config,
    "ct-int8": lambda: _ct_channel_config("int"),
    "ct-fp8": lambda: _ct_channel_config("float"),
    "fp8-block": lambda: {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
    },
}


def write_online(root: str, kind: str, seed: int = 0, family: str = "llama") -> tuple[str, str]:
    """(plain checkpoint dir, twin dir): the twin holds each projection quantized per channel to ``kind`` and back
    (each expert's too: a row of transformers' stacked expert tensors is one output channel of one expert)."""
    torch.manual_seed(seed)
    model = tiny_model(family)
    plain, twin = os.path.join(root, f"online-{kind}-plain"), os.path.join(root, f"online-{kind}-twin")
    model.save_pretrained(plain, safe_serialization=True)
    build_byte_tokenizer().save_pretrained(plain)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.rsplit(".", 2)[-2] in PROJECTIONS or name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                rows = param.float().reshape(-1, param.shape[-1])
                param.copy_(channel_tensors(rows, kind)[1].reshape(param.shape))
    model.save_pretrained(twin, safe_serialization=True)
    return plain, twin
