"""Prefill instance: computes a prompt and its first token on a vLLM engine."""
import argparse

from services.decode.handler import Decoder
from services.prefill.handler import Prefiller
from shared import metrics_page, service
from shared.engine.runtime import serving


def stage_count(text: str) -> int:
    stages = int(text)
    if stages < 1:
        raise argparse.ArgumentTypeError(f"a pipeline has at least 1 stage, got {stages}")
    return stages


def parser() -> argparse.ArgumentParser:
    p = service.parser("prefill", instance=True)
    p.add_argument("--stages", type=stage_count, default=1,
                   help="pipeline stages of this instance's engine: above 1, a CPP prefill group")
    metrics_page.add_arguments(p)
    return p


if __name__ == "__main__":
    # Decode orders too: the Conductor's fallback while no decode instance is live.
    service.run("prefill", serving(Prefiller, Decoder), parser().parse_args())
