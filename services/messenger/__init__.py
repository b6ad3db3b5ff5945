"""Messenger: one per node; owns the node's KV block pool and moves blocks between nodes."""
