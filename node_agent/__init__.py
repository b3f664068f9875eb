"""The node agent (DaemonSet): applies NodePartitioning specs through NVML, runs MPS, device plugin."""
