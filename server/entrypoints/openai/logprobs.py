"""Log-probabilities as the two OpenAI endpoints shape them (completions' lists, chat's token objects)."""

from __future__ import annotations

from typing import Any

from pagedllm.server.entrypoints.openai.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from pagedllm.server.outputs import CompletionOutput, Logprob, RequestOutput


class LogprobFormatter:
    """Turns the engine's per-token :class:`Logprob` maps into response objects."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def token_text(self, token_id: int, entry: Logprob | None = None) -> str:
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def add_completion(self, out: CompletionLogprobs, c: CompletionOutput, start: int, end: int, offset: int) -> int:
        """Append tokens ``start:end`` of ``c``; returns the text offset after them."""
        entries = c.logprobs or []
        for j in range(start, min(end, len(entries))):
            token_id, top = c.token_ids[j], entries[j]
            token = self.token_text(token_id, top.get(token_id))
            out.tokens.append(token)
            out.token_logprobs.append(top[token_id].logprob if token_id in top else None)
            out.top_logprobs.append({self.token_text(t, lp): lp.logprob for t, lp in top.items()})
            out.text_offset.append(offset)
            offset += len(token)
        return offset

    def add_prompt(self, out: CompletionLogprobs, output: RequestOutput) -> int:
        """Append the prompt's tokens (``echo``); returns the text offset after them."""
        entries = output.prompt_logprobs or []
        offset = 0
        for j, token_id in enumerate(output.prompt_token_ids):
            top = entries[j] if j < len(entries) else None
            token = self.token_text(token_id)
            out.tokens.append(token)
            out.token_logprobs.append(top[token_id].logprob if top and token_id in top else None)
            out.top_logprobs.append({self.token_text(t): lp.logprob for t, lp in top.items()} if top else None)
            out.text_offset.append(offset)
            offset += len(token)
        return offset

    def chat(self, c: CompletionOutput, start: int, end: int, num_top: int) -> ChatLogprobs:
        """Chat's ``logprobs.content`` for tokens ``start:end`` of ``c``, each with its ``num_top`` best."""
        content = []
        entries = c.logprobs or []
        for j in range(start, min(end, len(entries))):
            token_id, top = c.token_ids[j], entries[j]
            token = self.token_text(token_id, top.get(token_id))
            ranked = sorted(top.items(), key=lambda kv: kv[1].rank or 0)[:num_top]
            content.append(
                TokenLogprob(
                    token=token,
                    logprob=top[token_id].logprob if token_id in top else float("-inf"),
                    bytes=list(token.encode("utf-8")),
                    top_logprobs=[
                        TopLogprob(
                            token=(s := self.token_text(t, lp)), logprob=lp.logprob, bytes=list(s.encode("utf-8"))
                        )
                        for t, lp in ranked
                    ],
                )
            )
        return ChatLogprobs(content=content)
