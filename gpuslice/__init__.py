"""gpuslice command-line entry point (``gpuslice``)."""
