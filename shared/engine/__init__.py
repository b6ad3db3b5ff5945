"""What runs a vLLM engine instance (prefill or decode): the engine itself
(`llm`), the runtime that serves one role's requests over NATS (`runtime`), and the
vLLM plugin that lets several engines share a small machine (`spin`). Only the
engine services import this package's vLLM-facing modules."""
