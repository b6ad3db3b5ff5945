"""Log probabilities at the edge: each output token's, as the engines computed them
(`TokenLogprobs`: the first token's on prefill, the rest on decode), into OpenAI's
two shapes, chat's `content` list and the completions' parallel lists.

Token strings are vLLM's own: its logprobs processor decodes each token as `vllm
serve` does, with the tokens before it as context (so a byte-level piece that
completes a character reads the same), and the shapes follow vLLM's OpenAI server
field for field. vLLM is imported on the first request that asks for logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shared.messages import TokenLogprobs

FLOOR = -9999.0  # vLLM's (and OpenAI's) stand-in for -inf in JSON


def load_logprobs() -> None:
    """Import what `Logprobs` takes from vLLM (seconds: torch comes with it)."""
    import vllm.v1.engine.logprobs  # noqa: F401


class Logprobs:
    """One choice's log probabilities, as its tokens arrive."""

    def __init__(self, tokenizer: Any, top: int) -> None:
        from vllm.v1.engine.logprobs import LogprobsProcessor

        self.tokenizer = tokenizer
        self.top = top
        self._processor = LogprobsProcessor(tokenizer=tokenizer, logprobs=[], prompt_logprobs=None,
                                            cumulative_logprob=0.0, num_logprobs=top, num_prompt_logprobs=None)
        self.token_ids: list[int] = []
        self.text_offset = 0  # completions: where the next token's text starts

    @property
    def positions(self) -> list[dict[int, Any]]:
        """Per token: token id → vLLM Logprob (the sampled token first)."""
        return self._processor.logprobs

    def push(self, token_ids: Sequence[int], rows: Sequence[TokenLogprobs]) -> None:
        if len(rows) != len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens came with {len(rows)} log probability rows")
        if not rows:
            return
        import numpy as np
        from vllm.v1.outputs import LogprobsLists

        lists = LogprobsLists(np.array([r.token_ids for r in rows]), np.array([r.logprobs for r in rows]),
                              np.array([r.rank for r in rows]))
        self._processor._update_sample_logprobs(lists)
        self.token_ids.extend(token_ids)

    def chat(self, start: int = 0) -> dict[str, Any]:
        """Chat's `logprobs` for the tokens from `start` (a stream's new ones)."""
        content = []
        for token_id, position in zip(self.token_ids[start:], self.positions[start:]):
            items = list(position.items())[: self.top]  # vLLM's order: the sampled token, then the top
            content.append({**self._entry(token_id, position[token_id]),
                            "top_logprobs": [self._entry(t, x) for t, x in items]})
        return {"content": content}

    def completion(self, start: int = 0) -> dict[str, Any]:
        """Completions' `logprobs` for the tokens from `start`; text offsets continue
        from the last call's."""
        offsets, tokens, logprobs, tops = [], [], [], []
        for token_id, position in zip(self.token_ids[start:], self.positions[start:]):
            token = self._decoded(token_id, position[token_id])
            offsets.append(self.text_offset)
            self.text_offset += len(token)
            tokens.append(token)
            logprobs.append(max(position[token_id].logprob, FLOOR))
            # the top n, plus the sampled token's entry: n + 1 at most, as the OpenAI API defines it
            tops.append({self._decoded(t, x): max(x.logprob, FLOOR)
                         for i, (t, x) in enumerate(position.items()) if self.top >= i})
        return {"text_offset": offsets, "token_logprobs": logprobs, "tokens": tokens, "top_logprobs": tops}

    def _decoded(self, token_id: int, lp: Any) -> str:
        return lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode([token_id])

    def _entry(self, token_id: int, lp: Any) -> dict[str, Any]:
        token = self._decoded(token_id, lp)
        return {"token": token, "logprob": max(lp.logprob, FLOOR), "bytes": list(token.encode("utf-8", errors="replace"))}
