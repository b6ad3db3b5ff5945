"""Prefill instance: computes a prompt and its first token on a vLLM engine."""
from services.prefill.handler import Prefiller
from shared import service
from shared.engine.runtime import serving

if __name__ == "__main__":
    service.run("prefill", serving(Prefiller), service.parser("prefill", instance=True).parse_args())
