"""Prefill instance: computes a prompt and its first token on a vLLM engine."""
