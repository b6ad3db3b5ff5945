"""Prefill instance: computes a prompt and its first token on a vLLM engine."""
import argparse

from services.prefill.handler import Prefiller
from shared import service
from shared.engine.runtime import serving


def parser() -> argparse.ArgumentParser:
    return service.parser("prefill", instance=True)


if __name__ == "__main__":
    service.run("prefill", serving(Prefiller), parser().parse_args())
