"""Contracts shared by every Yuebing service: config, messages, logging, block hashes."""
