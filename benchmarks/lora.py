"""Multi-LoRA throughput: the same requests on the base model alone and spread over 1, 4 and 16
adapters batched together, all in one run on one machine.

Every scenario runs the same prompts (random token ids, ``--input-len`` long) to
``--output-len`` greedy tokens with EOS ignored, so each generates exactly the same tokens'
worth of work. ``base`` is an engine without LoRA; ``N adapters`` is an engine with
``enable_lora=True, max_loras=N`` whose requests take the N adapters in turn, so every step
mixes all of them. Adapters are random, of rank ``--rank``, on all seven projections
(written in PEFT's format here, no download). Loading and a warm-up are not timed.
``--repeats`` runs the scenarios in turn that many times (so a shared machine's drift hits
them alike) and reports the median; the ratio is each scenario's tokens/s over the base's.

    python -m benchmarks.lora --threads 2
    python -m benchmarks.lora --threads 1 --adapters 1,4 --num-requests 16 --output-len 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch
from tqdm.auto import tqdm

from benchmarks.common import HelpFormatter, set_threads
from benchmarks.throughput import MODEL_SHAPE

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_llama(path: str, shape: dict) -> None:
    """The throughput benchmark's random LLaMA, at the depth asked for."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**shape, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)


def write_random_adapter(path: str, shape: dict, rank: int, seed: int) -> str:
    """A PEFT LoRA directory for the benchmark model: random A and B on every projection."""
    from safetensors.torch import save_file

    hidden, inner = shape["hidden_size"], shape["intermediate_size"]
    kv = hidden // shape["num_attention_heads"] * shape["num_key_value_heads"]
    dims = {"q_proj": (hidden, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, hidden)}
    dims.update({"gate_proj": (inner, hidden), "up_proj": (inner, hidden), "down_proj": (hidden, inner)})
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape["num_hidden_layers"]):
        for proj, (out_features, in_features) in dims.items():
            prefix = f"base_model.model.model.layers.{layer}.{'self_attn' if proj in TARGETS[:4] else 'mlp'}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.02
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


def run_scenario(llm, prompts: list[list[int]], loras: list, output_len: int) -> float:
    """Generated tokens per second of one ``generate`` over all prompts."""
    from pagedllm.server import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def build_engines(model_dir: str, adapter_dirs: list[str], counts: list[int], args) -> dict:
    from pagedllm.server import LLM, LoRARequest

    common = dict(
        model=model_dir,
        skip_tokenizer_init=True,
        max_num_seqs=args.num_requests,
        max_model_len=args.input_len + args.output_len + 8,
    )
    engines = {"base": (LLM(**common), [None] * args.num_requests)}
    for n in counts:
        requests = [LoRARequest(f"adapter-{i}", i + 1, adapter_dirs[i]) for i in range(n)]
        llm = LLM(**common, enable_lora=True, max_loras=n, max_lora_rank=args.rank)
        engines[f"{n} adapters"] = (llm, [requests[i % n] for i in range(args.num_requests)])
    return engines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: what the CPUs allow)")
    parser.add_argument("--adapters", default="1,4,16", help="adapter counts, comma-separated")
    parser.add_argument("--rank", type=int, default=16, choices=(8, 16, 32, 64))
    parser.add_argument("--num-requests", type=int, default=32, help="requests per scenario, all in one batch")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=MODEL_SHAPE["num_hidden_layers"], help="model depth")
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    threads = set_threads(args.threads)
    counts = [int(n) for n in args.adapters.split(",")]
    shape = {**MODEL_SHAPE, "num_hidden_layers": args.layers}
    with tempfile.TemporaryDirectory() as root:
        model_dir = os.path.join(root, "model")
        save_llama(model_dir, shape)
        adapters = [write_random_adapter(os.path.join(root, f"a{i}"), shape, args.rank, i) for i in range(max(counts))]
        generator = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(3, shape["vocab_size"], (args.input_len,), generator=generator).tolist()
            for _ in range(args.num_requests)
        ]
        engines = build_engines(model_dir, adapters, counts, args)
        for llm, loras in engines.values():  # NOTE: warm-up: compile, load every adapter once
            run_scenario(llm, prompts, loras, 2)
        rates: dict[str, list[float]] = {name: [] for name in engines}
        with tqdm(total=args.repeats * len(engines), desc="scenarios") as bar:
            for _ in range(args.repeats):
                for name, (llm, loras) in engines.items():
                    rates[name].append(run_scenario(llm, prompts, loras, args.output_len))
                    bar.update(1)
    base = statistics.median(rates["base"])
    results = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch_threads": threads,
        "model": {**shape, "rank": args.rank},
        "requests": {"num": args.num_requests, "input_len": args.input_len, "output_len": args.output_len},
        "tokens_per_s": {name: statistics.median(r) for name, r in rates.items()},
        "ratio_to_base": {name: statistics.median(r) / base for name, r in rates.items()},
        "repeats": rates,
    }
    print(f"torch threads: {threads}; {args.num_requests} requests of {args.input_len}+{args.output_len} tokens")
    for name in engines:
        print(f"  {name:>12}: {results['tokens_per_s'][name]:8.1f} tok/s  ({results['ratio_to_base'][name]:.2f}x base)")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
