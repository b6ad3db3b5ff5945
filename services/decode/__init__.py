"""Decode instance: generates the tokens after the first on a vLLM engine."""
