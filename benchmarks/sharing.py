"""Memory saved by block sharing (the paper's Fig. 15), and by prefix caching.

For parallel sampling (n = 2, 4, 6) and beam search (width 2, 4, 6) on Alpaca-like and
ShareGPT-like lengths, every step records the KV blocks in use and the blocks the same
sequences would hold without sharing; saving = 1 - sum(used) / sum(unshared) over the
run. A tiny random LLaMA is enough: sharing depends on lengths, not on weights.

    python -m benchmarks.sharing --num-requests 40
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

from tqdm import tqdm

from benchmarks.common import HelpFormatter, set_threads
from benchmarks.workloads import sample_requests
from pagedllm.server import LLM, SamplingParams
from pagedllm.server.demo import save_tiny_llama

PAPER = {  # Fig. 15 of the paper, % saving
    ("alpaca", "parallel"): "6.1-9.8",
    ("alpaca", "beam"): "37.6-55.2",
    ("sharegpt", "parallel"): "16.2-30.5",
    ("sharegpt", "beam"): "44.3-66.3",
}


def measure(llm: LLM, requests, make_params) -> tuple[float, int]:
    engine = llm.llm_engine
    for i, r in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": r.prompt_token_ids}, make_params(r))
    used = unshared = steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.stats()
        used, unshared, steps = used + stats.blocks_used, unshared + stats.blocks_unshared, steps + 1
    return 1 - used / unshared, steps


def sharing_table(model_dir: str, args) -> list[dict]:
    rows = []
    cases = [(w, kind, k) for w in ("alpaca", "sharegpt") for kind in ("parallel", "beam") for k in (2, 4, 6)]
    for workload, kind, k in tqdm(cases, desc="cases"):
        requests = sample_requests(
            workload, args.num_requests, 256, seed=args.seed, max_input=900, max_output=args.max_output
        )
        llm = LLM(
            model=model_dir,
            skip_tokenizer_init=True,
            block_size=16,
            enable_prefix_caching=False,
            max_num_seqs=args.max_num_seqs,
            kv_cache_memory=2.0,
            max_num_batched_tokens=4096,
        )
        if kind == "parallel":

            def make_params(r, k=k):
                return SamplingParams(n=k, temperature=1.0, seed=0, max_tokens=r.output_len, ignore_eos=True)
        else:

            def make_params(r, k=k):
                return SamplingParams(
                    use_beam_search=True, best_of=k, n=k, temperature=0, max_tokens=r.output_len, ignore_eos=True
                )

        saving, steps = measure(llm, requests, make_params)
        rows.append(
            {
                "workload": workload,
                "method": kind,
                "k": k,
                "saving_pct": round(100 * saving, 1),
                "paper_pct": PAPER[(workload, kind)],
                "steps": steps,
            }
        )
    return rows


def prefix_caching(model_dir: str, args) -> dict:
    """Requests sharing a 512-token system prompt, with and without prefix caching."""
    system = list(range(1, 200)) * 3
    requests = sample_requests("alpaca", args.num_requests, 256, seed=args.seed)
    prompts = [{"prompt_token_ids": system[:512] + r.prompt_token_ids} for r in requests]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    result = {}
    for enabled in (False, True):
        llm = LLM(model=model_dir, skip_tokenizer_init=True, block_size=16, enable_prefix_caching=enabled)
        llm.generate(prompts[:1], params)  # the first request fills the cache
        start = time.perf_counter()
        outs = llm.generate(prompts[1:], params)
        elapsed = time.perf_counter() - start
        stats = llm.llm_engine.stats()
        result["on" if enabled else "off"] = {
            "seconds": round(elapsed, 3),
            "hits": stats.prefix_cache_hits,
            "queries": stats.prefix_cache_queries,
            "tokens": [o.outputs[0].token_ids for o in outs],
        }
    same = result["on"].pop("tokens") == result["off"].pop("tokens")
    return {
        **result,
        "identical_outputs": same,
        "speedup": round(result["off"]["seconds"] / result["on"]["seconds"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.sharing", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=40, help="requests per case")
    parser.add_argument("--max-output", type=int, default=1024, help="longest output, in tokens")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="engine max_num_seqs")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload")
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results"), help="directory the results are written to"
    )
    args = parser.parse_args()
    set_threads()
    with tempfile.TemporaryDirectory() as model_dir:
        save_tiny_llama(model_dir, max_position_embeddings=4096)
        rows = sharing_table(model_dir, args)
        prefix = prefix_caching(model_dir, args)
    print(f"{'workload':10} {'method':9} {'k':>2} {'saving %':>9} {'paper %':>10}")
    for r in rows:
        print(f"{r['workload']:10} {r['method']:9} {r['k']:>2} {r['saving_pct']:>9} {r['paper_pct']:>10}")
    print("prefix caching:", json.dumps(prefix))
    result = {
        "date": datetime.date.today().isoformat(),
        "device": "cpu",
        "command": "python -m benchmarks.sharing " + " ".join(sys.argv[1:]),
        "sharing": rows,
        "prefix_caching": prefix,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"sharing-{result['date']}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
