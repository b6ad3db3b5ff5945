"""Decode instance: generates the tokens after the first on a vLLM engine."""
import argparse

from services.decode.handler import Decoder
from services.prefill.handler import Prefiller
from shared import service
from shared.engine.runtime import serving


def parser() -> argparse.ArgumentParser:
    return service.parser("decode", instance=True)


if __name__ == "__main__":
    # Prefill orders too: the planner may move this instance to prefill (services/conductor/roles.py).
    service.run("decode", serving(Decoder, Prefiller), parser().parse_args())
