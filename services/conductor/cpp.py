"""Chunked pipeline-parallel prefill (CPP, Mooncake §5.1): how long a prompt takes on
a pipeline group, as plain arithmetic over the single-instance time model.

A group is `stages` instances, each owning an equal share of the model's layers. The
prompt is cut into chunks of at most `chunk_tokens`; chunk i runs on stage j as soon as
stage j is free and chunk i has left stage j−1, so different chunks of one prompt run
on different stages at once. Only stage boundaries communicate (one chunk's
activations), and a prompt of one chunk pays nothing but that hand-over.

The live Conductor places on it (services/conductor/policy.py) and the simulator runs
it (yuebing/lab/long_context.py); both call `pipeline_prefill_s`.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.predictor import Predictor


@dataclass(frozen=True, slots=True)
class PipelineGroup:
    stages: int
    chunk_tokens: int
    # Activations one token hands to the next stage (hidden size × dtype bytes), and
    # the link between stages (one 200 Gbps NIC, as the simulator's KV link); 0 bytes
    # models a hand-over that costs nothing. A hand-over follows its chunk's compute
    # and never waits for the link: two chunks' hand-overs do not compete.
    boundary_bytes_per_token: int = 0
    link_bytes_per_s: float = 25e9

    def __post_init__(self) -> None:
        if self.stages < 1 or self.chunk_tokens < 1 or self.boundary_bytes_per_token < 0 or self.link_bytes_per_s <= 0:
            raise ValueError(f"a pipeline group needs stages ≥ 1, chunk_tokens ≥ 1, boundary bytes ≥ 0 and a "
                             f"positive link, got {self}")


def chunks(new_tokens: int, cached_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """(new, cached-before-it) tokens of each chunk, in order."""
    out = []
    done = 0
    while done < new_tokens:
        n = min(chunk_tokens, new_tokens - done)
        out.append((n, cached_tokens + done))
        done += n
    return out


def stage_s(predictor: Predictor, new_tokens: int, cached_tokens: int, stages: int) -> float:
    """One chunk on one stage: the step's fixed cost whole (every stage pays its own
    launch and hand-over), the layers' work split evenly."""
    fixed = predictor.prefill_coef[0] / 1e3
    whole = predictor.prefill_s(new_tokens, cached_tokens)
    return fixed + max(0.0, whole - fixed) / stages


def pipeline_prefill_s(predictor: Predictor, group: PipelineGroup, new_tokens: int, cached_tokens: int = 0) -> float:
    """Seconds from the first chunk entering stage 0 to the last leaving the last
    stage, on an idle group."""
    return run_pipeline(predictor, group, new_tokens, cached_tokens, (0.0,) * group.stages)[-1]


def run_pipeline(predictor: Predictor, group: PipelineGroup, new_tokens: int, cached_tokens: int,
                 free: tuple[float, ...]) -> tuple[float, ...]:
    """When each stage is free again after this prompt, given when each was free before
    (`free`, one time per stage): chunk i starts on stage j when both stage j is free
    and the chunk's activations have arrived from stage j−1. A queue of prompts is this
    called once per prompt, so the next prompt's first chunks fill the stages the last
    one's final chunks leave."""
    if len(free) != group.stages:
        raise ValueError(f"{len(free)} stage times for a group of {group.stages} stages")
    ends = list(free)
    for n, p in chunks(new_tokens, cached_tokens, group.chunk_tokens):
        compute = stage_s(predictor, n, p, group.stages)
        handover = n * group.boundary_bytes_per_token / group.link_bytes_per_s
        arrived = 0.0
        for j in range(group.stages):
            ends[j] = max(arrived, ends[j]) + compute
            arrived = ends[j] + (handover if j < group.stages - 1 else 0.0)
    return tuple(ends)


def chunked_prefill_s(predictor: Predictor, new_tokens: int, cached_tokens: int, chunk_tokens: int) -> float:
    """The same prompt chunk by chunk on one instance (a group of one stage)."""
    return pipeline_prefill_s(predictor, PipelineGroup(1, chunk_tokens), new_tokens, cached_tokens)
