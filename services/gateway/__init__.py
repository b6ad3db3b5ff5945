"""Gateway: the OpenAI-compatible REST API in front of the cluster."""
