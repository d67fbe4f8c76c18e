"""The ``pagedllm`` command: ``generate``, ``serve``, ``download`` and ``operator``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from pagedllm.server.args import add_engine_args, engine_config_from_args
from pagedllm.server.entrypoints.download import add_download_parser
from pagedllm.server.entrypoints.serve import add_serve_parser
from pagedllm.server.version import package_version


def _add_generate(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("generate", help="Complete prompts offline with the engine and print the text.")
    p.add_argument("prompts", nargs="+", help="One or more prompts.")
    p.add_argument("--max-tokens", type=int, default=64, help="Tokens to generate per prompt (default: 64).")
    p.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature; 0 is greedy.")
    p.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass (default: 1.0).")
    p.add_argument("--top-k", type=int, default=0, help="Keep the k most likely tokens; 0 keeps all.")
    p.add_argument("--n", type=int, default=1, help="Completions per prompt (default: 1).")
    add_engine_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from pagedllm.server.llm import LLM
    from pagedllm.server.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        n=args.n,
        seed=config.model.seed,
    )
    with LLM.from_config(config) as llm:
        outputs = llm.generate(args.prompts, params)
    for output in outputs:
        for completion in output.outputs:
            print((output.prompt or "") + completion.text)
            print("-" * 40)
    return 0


def _add_operator(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    help_text = "Run the Kubernetes operator for PagedLLM resources."
    try:
        from pagedllm.operator.main import add_operator_args, run_operator
    except ImportError as exc:
        missing = exc.name or str(exc)
        hint = f"{missing} is not installed: pip install 'pagedllm[operator]'"
        p = subparsers.add_parser("operator", help=f"{help_text} (unavailable: {hint})", description=hint)
        p.set_defaults(func=lambda _: _missing_extra("operator", missing))
        return
    p = subparsers.add_parser("operator", help=help_text)
    add_operator_args(p)
    p.set_defaults(func=run_operator)


def _missing_extra(command: str, module: str) -> int:
    print(
        f"pagedllm {command}: error: {module} is not installed; install it with pip install 'pagedllm[{command}]'",
        file=sys.stderr,
    )
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm",
        description="PagedLLM: serve or run language models with a paged KV cache.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"pagedllm {package_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate(subparsers)
    add_serve_parser(subparsers)
    add_download_parser(subparsers)
    _add_operator(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        message = f"pagedllm {args.command}: error: {exc}"
        write_termination_message(message)
        parser.exit(2, message + "\n")


TERMINATION_LOG_ENV = "PAGEDLLM_TERMINATION_LOG"
KUBERNETES_TERMINATION_LOG = "/dev/termination-log"


def write_termination_message(message: str) -> None:
    """Leave why the process stopped where Kubernetes shows it (``kubectl describe pod``:
    the container's last state), when running in a container that has the file."""
    path = os.environ.get(TERMINATION_LOG_ENV) or KUBERNETES_TERMINATION_LOG
    if TERMINATION_LOG_ENV not in os.environ and not os.path.exists(path):
        return
    try:
        with open(path, "w") as f:
            f.write(message[-4000:])  # NOTE: Kubernetes keeps at most 4096 bytes of it
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
