"""Decode instance: generates the tokens after the first on a vLLM engine."""
import argparse

from services.decode.handler import Decoder
from services.prefill.handler import Prefiller
from shared import metrics_page, service
from shared.engine.runtime import serving


def parser() -> argparse.ArgumentParser:
    p = service.parser("decode", instance=True)
    metrics_page.add_arguments(p)
    return p


if __name__ == "__main__":
    # Prefill orders too: the planner may move this instance to prefill (services/conductor/roles.py).
    service.run("decode", serving(Decoder, Prefiller), parser().parse_args())
