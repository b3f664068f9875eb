"""What the simulator reads: workloads and clusters (files, the openb trace, the built-in
demo), how fractional GPU requests map to slices, resource names, and input limits."""
