"""Decode instance: generates the tokens after the first on a vLLM engine."""
import argparse

from services.decode.handler import Decoder
from shared import service
from shared.engine.runtime import serving


def parser() -> argparse.ArgumentParser:
    return service.parser("decode", instance=True)


if __name__ == "__main__":
    service.run("decode", serving(Decoder), parser().parse_args())
