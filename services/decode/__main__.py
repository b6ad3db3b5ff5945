"""Decode instance: generates the tokens after the first on a vLLM engine."""
from services.decode.handler import Decoder
from shared import service
from shared.engine.runtime import serving

if __name__ == "__main__":
    service.run("decode", serving(Decoder), service.parser("decode", instance=True).parse_args())
