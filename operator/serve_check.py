"""The rendered command line, parsed at reconcile by the real ``pagedllm serve`` parser.

An ``extraArgs`` typo (``--enable-chunked-prefil``) or a bad value (``--num-gpu-blocks-override x``)
would otherwise crash-loop every pod the rollout replaces; parsed here, it is a ``Degraded``
condition naming the argument, and nothing is applied.

NOTE: the parser is imported from ``pagedllm.server.entrypoints.serve``, which imports no torch
and no third-party package (the operator image has neither); its argparse errors are raised,
never ``sys.exit``.
"""

from __future__ import annotations

import argparse
from typing import NoReturn, cast

from pagedllm.operator.command import SERVE_COMMAND
from pagedllm.operator.spec_fields import SpecError


class ArgumentRefused(Exception):
    """What argparse would have printed before exiting 2."""


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ArgumentRefused(message)


def serve_parser() -> argparse.ArgumentParser:
    """``pagedllm serve``'s own parser (the console script's subcommand), raising instead of exiting."""
    from pagedllm.server.entrypoints.serve import add_serve_parser

    root = _RaisingParser(prog=SERVE_COMMAND[0], add_help=False)
    subparsers = cast("argparse._SubParsersAction[argparse.ArgumentParser]", root.add_subparsers())
    return add_serve_parser(subparsers)


def check_serve_args(args: list[str], extra_args: tuple[str, ...]) -> None:
    """Parse ``args`` (the rendered arguments, ``extra_args`` at their end) as the container will.

    Raises :class:`SpecError` naming the ``spec.extraArgs`` item the server would refuse.
    The spec's own fields were checked before (under their spec keys), so what fails here
    is what ``extra_args`` adds.
    """
    from pagedllm.server.args import engine_config_from_args
    from pagedllm.server.config import ConfigError
    from pagedllm.server.entrypoints.headless import check_node_role

    try:
        namespace = serve_parser().parse_args(args)
        check_node_role(engine_config_from_args(namespace), namespace.headless)
    except ArgumentRefused as exc:
        raise SpecError(_refusal(str(exc), extra_args)) from exc
    except ConfigError as exc:
        raise SpecError(_refusal(exc.message, extra_args, flag=exc.name)) from exc


def _refusal(message: str, extra_args: tuple[str, ...], flag: str | None = None) -> str:
    at = _culprit(message, extra_args, flag)
    where = f"spec.extraArgs[{at}]={extra_args[at]!r}" if at is not None else f"spec.extraArgs={list(extra_args)!r}"
    return f"{where} is refused by pagedllm serve: {message}"


def _culprit(message: str, extra_args: tuple[str, ...], flag: str | None) -> int | None:
    """The index of the ``extra_args`` item the message is about: the flag named, or the word quoted."""
    words = [flag.split(".", 1)[0]] if flag else []
    words += [word.strip("'\",:") for word in message.split()]
    for word in words:
        for index, arg in enumerate(extra_args):
            if word and (arg == word or arg.split("=", 1)[0] == word):
                return index
    for index, arg in enumerate(extra_args):  # a bad value: the flag before it
        if f"'{arg}'" in message and index > 0:
            return index - 1
    return None
