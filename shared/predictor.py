"""Time models fitted from measurement: prefill time of n new tokens over p cached
ones, decode step time of a batch, and KV transfer time.

A profile is a JSON file of measured rows (the format `yuebing profile` writes, and
of the GPU profile shipped in yuebing/lab/data/): {"phase": "prefill"|"decode", "n", "p", "batch", "ctx", "ms"}.
The models are polynomial regressions over the terms each phase's cost is made of:
  prefill(n, p)   ≈ a + b·n + c·n·p + d·n²      (linear layers + attention over prefix and self)
  step(batch, c)  ≈ a + b·batch + c·batch·ctx  (weights once per step + per-sequence attention)
fitted by least squares on relative error, since relative error is what we report.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np


def prefill_terms(n: float, p: float) -> tuple[float, ...]:
    return (1.0, n, n * p, n * n)


def decode_terms(batch: float, ctx: float) -> tuple[float, ...]:
    """`ctx`: mean context tokens per sequence in the batch."""
    return (1.0, batch, batch * ctx)


@dataclass(frozen=True)
class Row:
    phase: str
    n: int
    p: int
    batch: int
    ctx: int
    ms: float


def fit(rows: Sequence[Row], phase: str) -> tuple[float, ...]:
    """Least-squares coefficients minimising relative error over the phase's rows."""
    chosen = [r for r in rows if r.phase == phase]
    if len(chosen) < 4:
        raise ValueError(f"need at least 4 {phase} rows to fit, got {len(chosen)}")
    terms = prefill_terms if phase == "prefill" else decode_terms
    x = np.array([terms(*_args(r)) for r in chosen])
    y = np.array([r.ms for r in chosen])
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones(len(y)), rcond=None)
    return tuple(float(c) for c in coef)


def _args(r: Row) -> tuple[float, float]:
    return (r.n, r.p) if r.phase == "prefill" else (r.batch, r.ctx)


@dataclass(frozen=True)
class Predictor:
    prefill_coef: tuple[float, ...]
    decode_coef: tuple[float, ...]
    # KV bytes one token occupies (all layers, K and V) and the transport's bandwidth.
    kv_bytes_per_token: int = 0
    transfer_bytes_per_s: float = 1e9
    floor_s: float = 1e-4  # a fitted polynomial may dip below zero outside its data

    def scaled(self, prefill: float = 1.0, decode: float = 1.0) -> Predictor:
        """The same time model with prefill's and decode's times multiplied (another
        GPU, or a what-if)."""
        return replace(self, prefill_coef=tuple(c * prefill for c in self.prefill_coef),
                       decode_coef=tuple(c * decode for c in self.decode_coef))

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return 0.0
        a, b, c, d = self.prefill_coef  # prefill_terms, written out: this is the scheduler's hot path
        n = new_tokens
        return max(self.floor_s, (a + n * (b + c * cached_tokens + d * n)) / 1e3)

    def prefill_step_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """One engine step computing several prompts' chunks, (new, cached) tokens
        each: the step's fixed cost once, each chunk's linear and attention terms."""
        a = self.prefill_coef[0] / 1e3
        return max(self.floor_s, a + sum(self.prefill_s(n, p) - a for n, p in chunks if n > 0))

    def decode_step_s(self, batch: int, ctx_tokens: int) -> float:
        """One decode step for `batch` sequences holding `ctx_tokens` tokens in all."""
        if batch <= 0:
            return 0.0
        a, b, c = self.decode_coef  # decode_terms, written out
        return max(self.floor_s, (a + batch * b + c * ctx_tokens) / 1e3)

    def transfer_s(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def predict_ms(self, row: Row) -> float:
        if row.phase == "prefill":
            return self.prefill_s(row.n, row.p) * 1e3
        return self.decode_step_s(row.batch, row.batch * row.ctx) * 1e3


# --- time of a mixed step ------------------------------------------------------
def prefill_marginal_s(predictor: Predictor, chunks: Sequence[tuple[int, int]]) -> float:
    """What prefill chunks, (new, cached) tokens each, add to a step that pays its
    fixed cost anyway."""
    if not any(n > 0 for n, _ in chunks):
        return 0.0
    return max(0.0, predictor.prefill_step_s(chunks) - predictor.prefill_coef[0] / 1e3)


def mixed_step_s(predictor: Predictor, batch: int, ctx_tokens: int, chunks: Sequence[tuple[int, int]]) -> float:
    """One engine step decoding `batch` sequences over `ctx_tokens` tokens and
    computing prefill `chunks` beside them. Assumption: the decode step plus the
    chunks' marginal cost (their linear and attention terms), the step's fixed cost
    once: both phases' fixed cost is mostly reading the weights, which one step does
    once. Without a batch it is a plain prefill step."""
    if batch <= 0:
        return predictor.prefill_step_s(chunks) if any(n > 0 for n, _ in chunks) else 0.0
    return predictor.decode_step_s(batch, ctx_tokens) + prefill_marginal_s(predictor, chunks)


MOST_STEP_TOKENS = 8192  # an SLO-sized step's budget at the most (vLLM's largest default)
LEAST_STEP_TOKENS = 64  # ... and at the least: prefill must progress even where decode alone breaks the SLO


def slo_step_tokens(predictor: Predictor, batch: int, ctx_tokens: int, cached_tokens: int, slo_tbt_s: float) -> int:
    """A step's prefill budget sized to the TBT SLO (Sarathi-Serve's token budget, per
    step): the most new tokens (after `cached_tokens`) whose mixed step with this
    batch keeps `slo_tbt_s`, at least LEAST_STEP_TOKENS. What `step_tokens=0` means."""
    lo, hi = LEAST_STEP_TOKENS, MOST_STEP_TOKENS
    if mixed_step_s(predictor, batch, ctx_tokens, [(hi, cached_tokens)]) <= slo_tbt_s:
        return hi
    while hi - lo > 1:  # the step grows with its tokens: bisect for the last that fits
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if mixed_step_s(predictor, batch, ctx_tokens, [(mid, cached_tokens)]) <= slo_tbt_s else (lo, mid)
    return lo


# A decode engine's cap on one prompt's chunk (ClusterConfig.decode_chunk_tokens) is
# sized for this many sequences decoding beside it at half the model's context each;
# beside a busier batch the Conductor's own check (modes.fullest_step_s) spills nothing there.
CHUNK_BATCH = 16


def default_decode_chunk_tokens(predictor: Predictor, slo_tbt_s: float, max_model_len: int, step_tokens: int,
                                block_size: int) -> int:
    """The largest whole-block chunk of one prompt whose step, beside CHUNK_BATCH
    decodes, keeps the TBT SLO: what a decode engine prefills a spilled prompt by
    (never above the step's budget or the model's context: vLLM refuses that)."""
    tokens = slo_step_tokens(predictor, CHUNK_BATCH, CHUNK_BATCH * max_model_len // 2, 0, slo_tbt_s)
    return max(block_size, min(step_tokens, max_model_len, tokens) // block_size * block_size)


def read_rows(path: str | Path, model: str | None = None) -> list[Row]:
    data = json.loads(Path(path).read_text())
    rows = data["rows"]
    if model is not None:
        rows = [r for r in rows if r.get("model") == model]
        if not rows:
            raise ValueError(f"profile {path} has no rows for model {model!r}")
    return [Row(r["phase"], int(r["n"]), int(r["p"]), int(r["batch"]), int(r["ctx"]), float(r["ms"])) for r in rows]


def load_predictor(path: str | Path, model: str | None = None) -> Predictor:
    """Fit a predictor from a profile file; `model` picks rows of one model if it holds several."""
    data = json.loads(Path(path).read_text())
    rows = read_rows(path, model)
    meta = data.get("meta", {})
    return Predictor(
        prefill_coef=fit(rows, "prefill"),
        decode_coef=fit(rows, "decode"),
        kv_bytes_per_token=int(meta.get("kv_bytes_per_token", 0)),
        transfer_bytes_per_s=float(meta.get("transfer_GBps", 1.0)) * 1e9,
    )


# Mooncake-style SLOs: multiples of what one request alone takes on this hardware.
TTFT_SLO_FACTOR = 10.0
TBT_SLO_FACTOR = 5.0


def default_slos_ms(predictor: Predictor, max_model_len: int) -> tuple[float, float]:
    """(TTFT, TBT) SLOs, ms, for a cluster that sets none: a full-context prompt's lone
    prefill and a lone decode step at full context, times the factors above."""
    ttft = TTFT_SLO_FACTOR * predictor.prefill_s(max_model_len)
    tbt = TBT_SLO_FACTOR * predictor.decode_step_s(1, max_model_len)
    return round(ttft * 1e3, 1), round(tbt * 1e3, 1)


def mape(predictor: Predictor, rows: Sequence[Row]) -> float:
    """Mean absolute percentage error of the predictor on measured rows."""
    errors = [abs(predictor.predict_ms(r) - r.ms) / r.ms for r in rows]
    return 100.0 * sum(errors) / len(errors)
