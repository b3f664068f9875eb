"""Workload files from what a real cluster recorded: kubectl dumps and kube-state-metrics."""
