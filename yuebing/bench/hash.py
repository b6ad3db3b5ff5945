"""`yuebing bench hash`: the block hash's digest, sha256 (what shared/block_hash.py
uses) against xxh3-128 (what it used), on prompts of realistic lengths, and what the
difference is worth beside the rest of the gateway's work on one request.

Both digests run through shared/block_hash.py's own `chain`, so the times include the
loop and the packing of tokens that the gateway pays. The reference for "the rest of
the gateway's work" is the part that grows with the prompt as hashing does: tokenizing
the prompt with the model's tokenizer and JSON-encoding its tokens for the prefill and
the decode request. It leaves out HTTP, NATS and the rest, so the share it gives the
hash is an upper bound.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec
import xxhash
from msgspec import Meta

from shared.block_hash import Digest, chain, sha256_16

DIGESTS: dict[str, Digest] = {"xxh3-128": xxhash.xxh3_128_digest, "sha256/16": sha256_16}
BASELINE, CHOSEN = "xxh3-128", "sha256/16"
SALT = b"bench-model\0" + b"0" * 64  # as long as a served name plus a fingerprint
VOCAB = 128_256  # LLaMA-3's: token ids as large as a real prompt's


@dataclass(frozen=True)
class HashBench:
    """What to measure; each field is also a flag of `yuebing bench hash`."""

    prompt_tokens: Annotated[tuple[int, ...], Meta(description="prompt lengths, tokens")] = (4096, 32768, 131072)
    block_sizes: Annotated[tuple[int, ...], Meta(description="tokens per block")] = (128, 16)
    repeats: Annotated[int, Meta(description="timings per case; the median is reported")] = 31
    tokenizer: Annotated[
        str, Meta(description="model folder whose tokenizer times the gateway's other work (empty: skip it)")
    ] = ""
    seed: Annotated[int, Meta(description="seed of the prompts")] = 0


def medians_us(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median wall time of each `fn()` over `repeats` calls, microseconds. The calls
    take turns, so that a neighbour's load on a shared box weighs on each alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(max(1, repeats)):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def hash_case(tokens: list[int], block_size: int, repeats: int) -> dict:
    """One prompt and block size: each digest's time, and sha256's over xxh3's."""
    us = medians_us({name: lambda d=digest: chain(tokens, block_size, SALT, d) for name, digest in DIGESTS.items()},
                    repeats)
    blocks = len(tokens) // block_size
    return {
        "prompt_tokens": len(tokens), "block_size": block_size, "blocks": blocks,
        "us": us, "ns_per_block": {name: t * 1e3 / max(1, blocks) for name, t in us.items()},
        "ratio": us[CHOSEN] / us[BASELINE], "extra_us": us[CHOSEN] - us[BASELINE],
    }


def load_tokenizer(folder: str) -> Any | None:
    """The gateway's tokenizer for `folder`, or None when there is no folder to time."""
    if not folder or not Path(folder).is_dir():
        return None
    from transformers.utils import logging as hf_logging

    from services.gateway.text import Tokenizer

    hf_logging.set_verbosity_error()  # prompts beyond the tiny model's context are fine here
    return Tokenizer(folder)


def prompt_text(tokenizer: Any, n: int, rng: random.Random) -> str:
    """Text of about `n` tokens: random words, cut at the n-th token."""
    text = ""
    while len(ids := tokenizer.encode(text, add_special_tokens=False)) < n:
        text += " ".join(rng.choice(("the", "cache", "block", "prefill", "decode", "node", "42", "Ω"))
                         for _ in range(n)) + " "
    return tokenizer.decode(ids[:n], skip_special_tokens=False)


def gateway_us(tokenizer: Any, n: int, rng: random.Random, repeats: int) -> float:
    """The gateway's per-request work that grows with the prompt, hashing aside."""
    text = prompt_text(tokenizer, n, rng)
    encoder = msgspec.json.Encoder()

    def request() -> None:
        ids = tokenizer.encode(text)
        encoder.encode({"prompt_token_ids": ids})  # PrefillRequest
        encoder.encode({"prompt_token_ids": ids})  # DecodeRequest

    return medians_us({"gateway": request}, repeats)["gateway"]


def run(cfg: HashBench) -> dict:
    rng = random.Random(cfg.seed)
    tokenizer = load_tokenizer(cfg.tokenizer)
    results = []
    for n in cfg.prompt_tokens:
        tokens = [rng.randrange(VOCAB) for _ in range(n)]
        gateway = gateway_us(tokenizer, n, rng, cfg.repeats) if tokenizer is not None else None
        for block_size in cfg.block_sizes:
            case = hash_case(tokens, block_size, cfg.repeats)
            case["gateway_us"] = gateway
            case["share"] = _share(case, gateway)
            results.append(case)
    return {"benchmark": "hash", "baseline": BASELINE, "chosen": CHOSEN, "tokenizer": cfg.tokenizer if tokenizer else "",
            "results": results}


def _share(case: dict, gateway: float | None) -> float | None:
    """What switching adds, as a fraction of the request's gateway work with the old hash."""
    if gateway is None:
        return None
    return case["extra_us"] / (gateway + case["us"][BASELINE])


def table(result: dict) -> str:
    ref = f"; gateway = tokenize + encode with {result['tokenizer']}" if result["tokenizer"] else ""
    lines = [f"Block hash per prompt, one core, medians ({result['chosen']} vs {result['baseline']}{ref}):",
             (f"{'tokens':>8} {'block':>6} {'blocks':>7} {'xxh3 us':>9} {'sha256 us':>10} {'ratio':>6} "
              f"{'+us':>8} {'gateway us':>11} {'+share':>7}")]
    for r in result["results"]:
        gateway = "-" if r["gateway_us"] is None else f"{r['gateway_us']:.0f}"
        share = "-" if r["share"] is None else f"{100 * r['share']:.1f}%"
        lines.append(f"{r['prompt_tokens']:>8} {r['block_size']:>6} {r['blocks']:>7} {r['us'][BASELINE]:>9.0f} "
                     f"{r['us'][CHOSEN]:>10.0f} {r['ratio']:>6.2f} {r['extra_us']:>8.0f} {gateway:>11} {share:>7}")
    return "\n".join(lines)
