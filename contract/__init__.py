"""Shared contract between the partitioner and the node agent (no kopf, no Kubernetes client)."""
