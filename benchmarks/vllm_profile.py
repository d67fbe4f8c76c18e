"""vLLM's worker profiled on the step profile's requests: its torch.profiler table, per step."""

from __future__ import annotations

import os
import tempfile

from benchmarks.vllm_baseline import Job, run_offline


def vllm_profile(model_dir: str, requests, batch: int, threads: int, args) -> dict:
    """vLLM's worker operators over its profiled steps (self CPU ms per step), from its profiler's table."""
    with tempfile.TemporaryDirectory(prefix="vllm-profile-") as directory:
        job = Job(
            model=model_dir,
            requests=[(r.prompt_token_ids, r.output_len) for r in requests],
            dtype=args.dtype,
            max_num_seqs=batch,
            threads=threads,
            profile_dir=directory,
        )
        run_offline(args.vllm_python, job)
        tables = [name for name in os.listdir(directory) if name.endswith("profiler_out.txt")]
        if not tables:
            raise RuntimeError(f"vLLM's profiler wrote no operator table into {directory}")
        with open(os.path.join(directory, tables[0])) as f:
            text = f.read()
    rows = parse_profiler_table(text)
    steps_rows = [(total, calls) for name, _, total, calls in rows if name.startswith("execute_context")]
    steps = sum(calls for _, calls in steps_rows) or 1
    ops = [(name, ms / steps, calls // steps) for name, ms, _, calls in rows]
    return {
        "vllm_profiled_steps": steps,
        "vllm_step_ms": sum(total for total, _ in steps_rows) / steps,
        "vllm_ops_ms_per_step": ops,
        "vllm_profiler_table": text,
    }


def parse_profiler_table(text: str) -> list[tuple[str, float, float, int]]:
    """(name, self CPU ms, CPU total ms, calls) per row of torch.profiler's ``key_averages().table()``."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().split("  ") if c.strip()]
        if len(cells) < 7 or not cells[-1].isdigit():
            continue
        rows.append((cells[0], _ms(cells[2]), _ms(cells[4]), int(cells[-1])))
    return rows


def _ms(cell: str) -> float:
    number = cell.rstrip("mus")
    return float(number) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[cell[len(number) :]]
