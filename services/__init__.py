"""Yuebing's services, one package each: `python -m services.<name>`."""
