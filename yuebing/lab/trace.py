"""Request traces in Mooncake's published format, and synthetic ones.

One JSON object a line: `timestamp` (ms from the start), `input_length`,
`output_length`, `hash_ids` (one id per 512-token block of the prompt; equal ids mean
an equal prefix block; the last block may be partial). The simulator replays these
at GPU scale; `yuebing bench replay` scales them down to a small model. A file may be
gzipped (the shipped `yuebing.lab.data.CONVERSATION_TRACE` is).
"""

from __future__ import annotations

import gzip
import itertools
import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, TextIO

from msgspec import Meta

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class TraceError(ValueError):
    pass


def _parse_line(line: str, where: str) -> TraceRequest:
    try:
        raw = json.loads(line)
        req = TraceRequest(float(raw["timestamp"]), int(raw["input_length"]), int(raw["output_length"]),
                           tuple(int(h) for h in raw["hash_ids"]))
    except (ValueError, KeyError, TypeError) as e:
        raise TraceError(f"{where}: not a trace record ({e.__class__.__name__}: {e})") from e
    if req.timestamp_ms < 0 or req.input_length <= 0 or req.output_length <= 0:
        raise TraceError(f"{where}: timestamp must be >= 0 and lengths positive")
    if len(req.hash_ids) != math.ceil(req.input_length / TRACE_BLOCK_TOKENS):
        raise TraceError(f"{where}: {len(req.hash_ids)} hash ids for {req.input_length} tokens "
                         f"of {TRACE_BLOCK_TOKENS}-token blocks")
    return req


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a trace, plain or gzipped; sorted by arrival. Any bad line is an error
    naming the line."""
    out = []
    with _open_text(Path(path)) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                out.append(_parse_line(line, f"{path}:{number}"))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise TraceError(f"{path}: no requests")
    return sorted(out, key=lambda r: r.timestamp_ms)


def _open_text(path: Path) -> TextIO:
    """The file as text, through gzip when it starts with gzip's magic bytes."""
    with path.open("rb") as f:
        zipped = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rt", encoding="utf-8") if zipped else path.open(encoding="utf-8")


@dataclass(frozen=True)
class SyntheticSpec:
    """A synthetic trace: Poisson arrivals, log-normal lengths, some requests opening
    with one of a few common prefixes."""

    requests: int = 1000
    rate_per_s: Annotated[float, Meta(description="synthetic arrivals per second (Poisson)")] = 1.0
    input_mean: Annotated[int, Meta(description="synthetic prompt tokens, log-normally spread")] = 8192
    output_mean: Annotated[int, Meta(description="synthetic output tokens, log-normally spread")] = 350
    length_sigma: Annotated[float, Meta(description="sigma of the synthetic lengths' log-normal")] = 0.6
    shared_prefix_ratio: Annotated[float, Meta(description="share of synthetic requests with a common prefix")] = 0.5
    prefixes: Annotated[int, Meta(description="distinct common prefixes of the synthetic trace")] = 8
    prefix_share_of_input: Annotated[float, Meta(description="how much of such a prompt the prefix is")] = 0.5
    seed: Annotated[int, Meta(description="seed of the synthetic trace (and of the simulator's random choices)")] = 0


def synthetic(spec: SyntheticSpec) -> list[TraceRequest]:
    rng = random.Random(spec.seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    prefix_blocks = max(1, int(spec.input_mean * spec.prefix_share_of_input) // TRACE_BLOCK_TOKENS)
    prefixes = [fresh(prefix_blocks) for _ in range(spec.prefixes)]
    t, out = 0.0, []
    for _ in range(spec.requests):
        t += rng.expovariate(spec.rate_per_s) * 1e3
        n_in = max(1, int(rng.lognormvariate(math.log(spec.input_mean), spec.length_sigma)))
        n_out = max(1, int(rng.lognormvariate(math.log(spec.output_mean), spec.length_sigma)))
        blocks = math.ceil(n_in / TRACE_BLOCK_TOKENS)
        ids = rng.choice(prefixes)[:blocks] if rng.random() < spec.shared_prefix_ratio else []
        ids = ids + fresh(blocks - len(ids))
        out.append(TraceRequest(round(t, 3), n_in, n_out, tuple(ids)))
    return out


def base_rate(trace: Sequence[TraceRequest]) -> float:
    """Requests/s of the trace at speed 1: its requests over the span of its timestamps."""
    span_s = max((r.timestamp_ms for r in trace), default=0.0) / 1e3
    return len(trace) / span_s if len(trace) > 1 and span_s > 0 else 0.0


def rescale(trace: Sequence[TraceRequest], speed: float = 1.0, length_factor: float = 1.0,
            max_input: int | None = None, max_output: int | None = None) -> list[TraceRequest]:
    """Replay `speed`× faster and with lengths × `length_factor` (hash ids kept, so a
    block of 512 trace tokens becomes 512·factor tokens), capped to a model's limits."""
    if speed <= 0 or length_factor <= 0:
        raise ValueError("speed and length_factor must be positive")
    out = []
    for r in trace:
        n_in = max(1, round(r.input_length * length_factor))
        n_out = max(1, round(r.output_length * length_factor))
        if max_input is not None:
            n_in = min(n_in, max_input)
        if max_output is not None:
            n_out = min(n_out, max_output)
        block = TRACE_BLOCK_TOKENS * length_factor
        ids = r.hash_ids[: max(1, math.ceil(n_in / block))]
        out.append(TraceRequest(r.timestamp_ms / speed, n_in, n_out, ids))
    return out


@dataclass(frozen=True)
class Mix:
    """How a part of a trace is reshaped: prompts and outputs scaled, and a document
    of `document_tokens` appended to every prompt (unshared: a file each user pastes),
    which makes every prompt long where scaling keeps the short ones short."""

    input_factor: float = 1.0
    output_factor: float = 1.0
    document_tokens: int = 0

    def __post_init__(self) -> None:
        if min(self.input_factor, self.output_factor) <= 0 or self.document_tokens < 0:
            raise ValueError("a mix's length factors must be positive and its document at least 0 tokens")

    @classmethod
    def parse(cls, text: str) -> Mix:
        """'IN,OUT' or 'IN,OUT,DOC' (factors, then document tokens)."""
        try:
            numbers = [float(x) for x in text.split(",")]
            if len(numbers) not in (2, 3):
                raise ValueError
        except ValueError:
            raise ValueError(f"a mix is input,output[,document tokens]: got {text!r}") from None
        return cls(numbers[0], numbers[1], round(numbers[2]) if len(numbers) == 3 else 0)


def shifting(trace: Sequence[TraceRequest], middle: Mix = Mix(3.0, 0.125), outer: Mix = Mix()) -> list[TraceRequest]:
    """A mix that shifts and comes back: the trace in thirds, the middle third's
    requests reshaped by `middle` and the outer thirds' by `outer`, at the same
    arrival times; blocks a longer prompt adds are unshared. The default: the trace,
    then long prompts with short answers, then the trace again (docs/simulator.md,
    "Roles that follow the load")."""
    _, lo, hi, _ = third_cuts(len(trace))
    fresh = itertools.count(max((h for r in trace for h in r.hash_ids), default=0) + 1)
    return [_reshaped(r, middle if lo <= i < hi else outer, fresh) for i, r in enumerate(trace)]


def third_cuts(n: int) -> tuple[int, int, int, int]:
    """Where `shifting` cuts n requests into thirds (the last takes the remainder)."""
    return 0, n // 3, 2 * (n // 3), n


def _reshaped(r: TraceRequest, mix: Mix, fresh: Iterator[int]) -> TraceRequest:
    if mix == Mix():
        return r
    n_in = max(1, round(r.input_length * mix.input_factor)) + mix.document_tokens
    blocks = math.ceil(n_in / TRACE_BLOCK_TOKENS)
    ids = r.hash_ids[:blocks] + tuple(next(fresh) for _ in range(blocks - len(r.hash_ids)))
    return TraceRequest(r.timestamp_ms, n_in, max(1, round(r.output_length * mix.output_factor)), ids)


def tiled(trace: Sequence[TraceRequest], copies: int) -> list[TraceRequest]:
    """`copies` times the users: each copy of the trace arrives at its own times
    shifted by a fraction of the mean gap (the copies interleave, no burst of
    simultaneous arrivals), its blocks renamed so that copies share no prefix (other
    users' prompts). Rate and fleet then grow together (docs/simulator.md, "Fleet scale")."""
    if copies < 1:
        raise ValueError("copies must be at least 1")
    top = max((h for r in trace for h in r.hash_ids), default=-1) + 1
    gap_ms = max((r.timestamp_ms for r in trace), default=0.0) / max(1, len(trace)) / copies
    out = [TraceRequest(r.timestamp_ms + c * gap_ms, r.input_length, r.output_length,
                        tuple(h + c * top for h in r.hash_ids))
           for c in range(copies) for r in trace]
    out.sort(key=lambda r: r.timestamp_ms)
    return out
