"""The NATS auth callout: logs engine pods in by their Kubernetes ServiceAccount tokens."""
