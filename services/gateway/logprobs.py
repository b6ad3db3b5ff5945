"""Log probabilities at the edge: each token's, as the engines computed them
(`TokenLogprobs`: the prompt's and the first token's on prefill, the rest on decode),
into OpenAI's two shapes, chat's `content` list and the completions' parallel lists,
and vLLM's own `prompt_logprobs` shape.

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
    """Import what this module takes from vLLM (seconds: torch comes with it)."""
    import vllm.v1.engine.logprobs  # noqa: F401


def _arrays(rows: Sequence[TokenLogprobs]) -> tuple[Any, Any, Any]:
    import numpy as np

    return (np.array([r.token_ids for r in rows]), np.array([r.logprobs for r in rows]),
            np.array([r.rank for r in rows]))


def prompt_positions(tokenizer: Any, rows: Sequence[TokenLogprobs], top: int) -> list[dict[int, Any] | None]:
    """vLLM's prompt logprobs from prefill's rows: None for the first token (nothing
    precedes it), then token id → Logprob (the prompt's token first, then the top)."""
    from vllm.v1.engine.logprobs import LogprobsProcessor

    processor = LogprobsProcessor(tokenizer=tokenizer, logprobs=None, prompt_logprobs=[None], cumulative_logprob=None,
                                  num_logprobs=None, num_prompt_logprobs=top)
    if rows:
        processor._update_prompt_logprobs(_arrays(rows))
    return processor.prompt_logprobs


def prompt_json(positions: Sequence[dict[int, Any] | None]) -> list[dict[str, Any] | None]:
    """The `prompt_logprobs` field, as vLLM's server serializes its Logprob objects."""
    return [None if p is None else {str(t): {"logprob": max(lp.logprob, FLOOR), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token}
                                    for t, lp in p.items()} for p in positions]


class Logprobs:
    """One choice's log probabilities, as its tokens arrive (after the prompt's, when
    a completion echoes its prompt)."""

    def __init__(self, tokenizer: Any, top: int) -> None:
        from vllm.v1.engine.logprobs import LogprobsProcessor

        self.tokenizer = tokenizer
        self.top = top
        self._processor = LogprobsProcessor(tokenizer=tokenizer, logprobs=[], prompt_logprobs=None,
                                            cumulative_logprob=0.0, num_logprobs=top, num_prompt_logprobs=None)
        self._echoed: list[dict[int, Any] | None] = []  # the prompt's positions, leading the output's
        self.token_ids: list[int] = []
        self.reported = 0  # positions a stream has sent
        self.text_offset = 0  # completions: where the next token's text starts

    @property
    def positions(self) -> list[dict[int, Any] | None]:
        """Per token: token id → vLLM Logprob (the sampled token first); None: none."""
        return [*self._echoed, *self._processor.logprobs]

    def echo(self, prompt: Sequence[int], positions: Sequence[dict[int, Any] | None]) -> None:
        """Completions' echo: the prompt's tokens and logprobs lead the output's."""
        self._echoed = list(positions)
        self.token_ids = [*prompt, *self.token_ids]

    def push(self, token_ids: Sequence[int], rows: Sequence[TokenLogprobs]) -> None:
        if len(rows) != len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens came with {len(rows)} log probability rows")
        if not rows:
            return
        from vllm.v1.outputs import LogprobsLists

        self._processor._update_sample_logprobs(LogprobsLists(*_arrays(rows)))
        self.token_ids.extend(token_ids)

    def new(self, kind: str) -> dict[str, Any]:
        """A stream's part: the positions not sent yet."""
        out = self.chat(self.reported) if kind == "chat" else self.completion(self.reported)
        self.reported = len(self.token_ids)
        return out

    def chat(self, start: int = 0) -> dict[str, Any]:
        """Chat's `logprobs` for the tokens from `start`."""
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
            lp = None if position is None else position[token_id]
            token = self._decoded(token_id, lp)
            offsets.append(self.text_offset)
            self.text_offset += len(token)
            tokens.append(token)
            logprobs.append(None if lp is None else max(lp.logprob, FLOOR))
            # the top n, plus the sampled token's entry: n + 1 at most, as the OpenAI API defines it
            tops.append(None if position is None else {self._decoded(t, x): max(x.logprob, FLOOR)
                                                       for i, (t, x) in enumerate(position.items()) if self.top >= i})
        return {"text_offset": offsets, "token_logprobs": logprobs, "tokens": tokens, "top_logprobs": tops}

    def _decoded(self, token_id: int, lp: Any) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode(token_id)

    def _entry(self, token_id: int, lp: Any) -> dict[str, Any]:
        token = self._decoded(token_id, lp)
        return {"token": token, "logprob": max(lp.logprob, FLOOR), "bytes": list(token.encode("utf-8", errors="replace"))}
