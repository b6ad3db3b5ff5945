"""`yuebing bench long-context`: a prompt near the context limit, prefilled by one
prefill instance and by a CPP group (one engine pipelined over `stages` processes),
live, with greedy outputs checked against plain vLLM.

Two clusters run one after the other (never at once: they would share the CPU):
- single: `yuebing up --prefill 1 --decode 1`;
- cpp: `yuebing up --prefill 0 --cpp-groups 1 --cpp-stages S --decode 1`, so every
  prompt goes through the group.
Both cut prompts into the same `chunk_tokens` (`--step-tokens`), so the only
difference is whether a prompt's chunks overlap across stages. Each measured prompt
is new (no prefix cache helps); TTFT is the streaming client's time to the first
token, medians over `repeats`. Plain vLLM (an in-process engine, same dtype) then
generates the same prompts greedily, and every output must match it token for token.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

from msgspec import Meta

from shared.config import ClusterConfig
from shared.engine.llm import engine_environment
from yuebing import client
from yuebing.bench.ttft import LiveBench, prompts
from yuebing.bench.ttft import cluster_flags as live_flags
from yuebing.launcher import up_process

WARMUP = 2  # prompts each cluster serves before it is measured (first long prompts allocate)


@dataclass(frozen=True)
class LongContextBench(LiveBench):
    """`bench long-context`'s run: a live benchmark's settings (the command asks for a
    prompt near the context limit) and the group's; each field is also a flag."""

    output_tokens: Annotated[int, Meta(description="greedy tokens generated per prompt, compared with plain vLLM")] = 16
    stages: Annotated[int, Meta(description="pipeline stages of the CPP group")] = 2
    chunk_tokens: Annotated[int, Meta(description="prefill chunk, both clusters (--step-tokens)")] = 512

    def __post_init__(self) -> None:
        if self.prompt_tokens + self.output_tokens > self.max_model_len:
            raise ValueError(f"{self.prompt_tokens} prompt + {self.output_tokens} output tokens exceed the "
                             f"context limit of {self.max_model_len}")
        if self.stages < 2 or self.repeats < 1 or self.output_tokens < 1:
            raise ValueError("--stages must be at least 2, --repeats and --output-tokens at least 1")


@dataclass(frozen=True)
class Run:
    """One cluster's measured prompts."""

    name: str
    ttft_s: list[float]
    outputs: list[list[int]]
    prefill_instances: list[str]
    decode_loaded_tokens: list[int | None]

    @property
    def median_ttft_s(self) -> float:
        return statistics.median(self.ttft_s)


async def measure(url: str, spec: LongContextBench, name: str, batch: list[list[int]], warmup: list[list[int]]) -> Run:
    async with client.session() as session:
        for p in warmup:
            (await client.stream(session, url, client.completion_body(spec.model.name, p, spec.output_tokens))).check()
        got = [(await client.stream(session, url, client.completion_body(spec.model.name, p, spec.output_tokens))).check()
               for p in batch]
    reports = [g.yuebing or {} for g in got]
    return Run(name, [g.ttft_s or 0.0 for g in got], [g.token_ids for g in got],
               [r.get("prefill_instance", "") for r in reports], [r.get("decode_kv_loaded_tokens") for r in reports])


def cluster_flags(spec: LongContextBench, cpp: bool) -> list[str]:
    layout = ["--prefill", "0", "--cpp-groups", "1", "--cpp-stages", str(spec.stages)] if cpp else ["--prefill", "1"]
    return live_flags(spec, "--step-tokens", str(spec.chunk_tokens), "--decode", "1", *layout)


def plain_vllm(spec: LongContextBench, batch: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of one plain vLLM engine (eager, as the clusters' engines are)."""
    import os

    for key, value in engine_environment(ClusterConfig()).items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(spec.model), max_model_len=spec.max_model_len, dtype=spec.dtype, enforce_eager=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=spec.output_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def run(spec: LongContextBench, say=print) -> dict:
    batch = prompts(spec.repeats, spec.prompt_tokens, random.Random(1))
    runs = []
    with tempfile.TemporaryDirectory(prefix="yuebing-long-") as tmp:
        for cpp in (False, True):
            name = f"cpp-{spec.stages}" if cpp else "single"
            say(f"{name}: yuebing up {' '.join(cluster_flags(spec, cpp)[6:])} …")
            # A different warm-up per cluster, none sharing a block with the measured prompts.
            warmup = prompts(WARMUP, spec.prompt_tokens, random.Random(2 + cpp))
            with up_process(Path(tmp), name, *cluster_flags(spec, cpp)) as url:
                runs.append(asyncio.run(measure(url, spec, name, batch, warmup)))
    say("plain vLLM: the same prompts, greedy …")
    reference = plain_vllm(spec, batch)
    return result(spec, runs[0], runs[1], reference)


def result(spec: LongContextBench, single: Run, cpp: Run, reference: list[list[int]]) -> dict:
    """The JSON the issue asks for (`prompt_tokens`, `stages`, `ttft_single_s`,
    `ttft_cpp_s`, `outputs_match`), with the runs behind it."""
    return {
        "prompt_tokens": spec.prompt_tokens,
        "stages": spec.stages,
        "chunk_tokens": spec.chunk_tokens,
        "ttft_single_s": single.median_ttft_s,
        "ttft_cpp_s": cpp.median_ttft_s,
        "ratio": cpp.median_ttft_s / single.median_ttft_s,
        "outputs_match": single.outputs == reference and cpp.outputs == reference,
        "runs": [asdict(single), asdict(cpp)],
    }


def table(out: dict) -> str:
    single, cpp = out["runs"]
    full_blocks = [n for n in cpp["decode_loaded_tokens"] if n is not None]
    lines = [
        f"{out['prompt_tokens']}-token prompts, chunks of {out['chunk_tokens']}, median TTFT over {len(single['ttft_s'])}:",
        "| prefill | TTFT s | × single |",
        "|---|---|---|",
        f"| one instance | {out['ttft_single_s']:.3f} | 1.00 |",
        f"| CPP group, {out['stages']} stages | {out['ttft_cpp_s']:.3f} | {out['ratio']:.2f} |",
        f"greedy outputs equal plain vLLM's: {'yes' if out['outputs_match'] else 'NO'}; "
        f"decode loaded {min(full_blocks, default=0)}–{max(full_blocks, default=0)} prompt tokens after the CPP prefill",
    ]
    return "\n".join(lines)
