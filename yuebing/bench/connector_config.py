"""The settings of `yuebing bench connector` (yuebing/bench/connector.py), apart from
the bench so that building the command's flags does not import torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from msgspec import Meta

from yuebing.shapes import SHAPES as SHAPES_KNOWN

# The shapes the bench can run (yuebing/shapes.py): the 70B one needs more than a GPU.
SHAPES = {name: SHAPES_KNOWN[name] for name in ("tiny", "llama3-8b")}
# What the bench holds a GPU to: saves cost at most 5 %, every layer noted within
# 10 ms of the forward's end, loads at 40 GB/s or more.
GPU_BAR = {"ratio": 1.05, "noted_ms": 10.0, "load_gbps": 40.0}


@dataclass(frozen=True)
class ConnectorBench:
    """What to measure; each field is also a flag of `yuebing bench connector`."""

    device: Annotated[str, Meta(description="cpu, cuda, or auto (cuda where one answers)")] = "auto"
    model_shape: Annotated[str, Meta(description="tiny, llama3-8b, or auto (llama3-8b on cuda, tiny on cpu)")] = "auto"
    tokens: Annotated[tuple[int, ...], Meta(description="prompt lengths, tokens")] = (2048, 8192, 16384)
    repeats: Annotated[int, Meta(description="timed runs per case; the median is reported")] = 5
    warmup: Annotated[int, Meta(description="untimed runs first")] = 2
    checksum_threads: Annotated[int, Meta(description="threads checksumming saved layers (0: one per core, up to 8)")] = 0
    save_copies: Annotated[str, Meta(description="how a GPU's saves cross: blocks (one torch copy per block) or "
                                    "dma (the copy engine, one transfer per run of consecutive slots)")] = "blocks"
    load_copies: Annotated[str, Meta(description="how a GPU's loads cross: dma or blocks")] = "dma"
