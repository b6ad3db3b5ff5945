"""Conductor: the global scheduler that picks a prefill and a decode instance."""
