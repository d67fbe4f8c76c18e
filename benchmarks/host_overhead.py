"""The engine's host work per decode step, with a model too small to matter.

A 2-layer LLaMA of hidden size 64 makes the forward pass negligible, so the wall time of
``engine.step()`` is what scheduling, building the step's inputs, the worker's input batch,
sampling bookkeeping, output processing and (with a tokenizer) detokenization cost per step:
the time a fast device waits on the host. Reports the median µs per decode step at each batch
size, with token ids only and with text (and with outputs after every step, or, as
``LLM.generate`` asks, only the last: ``--output-kinds``), and the functions with the most own
time in a cProfile of the decode steps.

    python -m benchmarks.host_overhead --batches 64 256 --steps 100 --output-kinds cumulative final_only
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time

TINY = dict(
    vocab_size=2000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)


def write_tiny_model(path: str, vocab: int = TINY["vocab_size"]) -> None:
    """A random 2-layer, hidden-64 LLaMA in float32 with a tokenizer of its ``vocab`` tokens."""
    import torch
    import transformers

    from benchmarks.model_shapes import write_tokenizer

    torch.manual_seed(0)
    fields = TINY | {"vocab_size": vocab}
    config = transformers.LlamaConfig(**fields, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, vocab, TINY["max_position_embeddings"])


def decode_steps(
    llm,
    batch: int,
    prompt_len: int,
    steps: int,
    profile: cProfile.Profile | None,
    vocab: int = 1003,
    final_only: bool = False,
) -> list[float]:
    """Seconds of each ``engine.step()`` once all ``batch`` sequences decode (prefill excluded);
    prompt ids are drawn below ``vocab``. ``final_only``: the requests ask for their last output
    only (``RequestOutputKind.FINAL_ONLY``, as ``LLM.generate`` does)."""
    from pagedllm.server import RequestOutputKind, SamplingParams

    engine = llm.llm_engine
    kind = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.CUMULATIVE
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True, output_kind=kind)
    for i in range(batch):
        prompt = [3 + (i * 7 + j) % (min(vocab, 1003) - 3) for j in range(prompt_len)]
        engine.add_request(f"r{batch}-{i}", {"prompt_token_ids": prompt}, params)
    times: list[float] = []
    while engine.has_unfinished_requests():
        decoding = len(times) < steps and _all_decoding(engine)
        if decoding and profile is not None:
            profile.enable()
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        failed = [o.error for o in outputs if o.error is not None]
        if failed:
            raise RuntimeError(f"a request failed: {failed[0]}")
        if decoding:
            if profile is not None:
                profile.disable()
            times.append(elapsed)
    return times


def _all_decoding(engine) -> bool:
    """Whether every request has its prompt prefilled (the next step is a pure decode step)."""
    scheduler = engine.scheduler
    return not scheduler.waiting and all(not seq.is_prefill for g in scheduler.running for seq in g.seqs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256], help="decoding sequences per step")
    p.add_argument("--steps", type=int, default=100, help="decode steps timed per batch")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--modes", nargs="+", default=["ids", "text"], choices=["ids", "text"])
    p.add_argument(
        "--output-kinds",
        nargs="+",
        default=["cumulative"],
        choices=["cumulative", "final_only"],
        help="each request's outputs: after every step, or its last only (what LLM.generate asks for)",
    )
    p.add_argument("--top", type=int, default=15, help="functions listed by own time (0: no profile)")
    p.add_argument("--vocab", type=int, default=TINY["vocab_size"], help="vocabulary of a new model")
    p.add_argument("--model", default=None, help="a model directory: reused if it holds one, else written there")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    from benchmarks.model_shapes import model_vocab
    from pagedllm.server import LLM

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tmp
        if not os.path.exists(os.path.join(model, "config.json")):
            write_tiny_model(model, args.vocab)
        for mode in args.modes:
            llm = LLM(
                model=model,
                skip_tokenizer_init=mode == "ids",
                max_num_seqs=max(args.batches),
                max_model_len=1024,
                max_num_batched_tokens=max(args.batches) * args.prompt_len,
                cpu_threads=args.threads,
                dtype="float32",
            )
            vocab = model_vocab(model)
            decode_steps(llm, 4, args.prompt_len, 4, None, vocab)  # warm-up
            for batch in args.batches:
                for kind in args.output_kinds:
                    profile = cProfile.Profile() if args.top else None
                    final = kind == "final_only"
                    times = decode_steps(llm, batch, args.prompt_len, args.steps, profile, vocab, final)
                    us = statistics.median(times) * 1e6
                    label = f"{mode}, final only" if final else mode
                    print(f"[{label}] batch {batch}: {us:.0f} us per decode step (median of {len(times)})")
                    if profile is not None:
                        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
            llm.shutdown()


if __name__ == "__main__":
    main()
