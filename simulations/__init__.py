"""Simulator and benchmarks: trace loaders, the what-if engine, planner benchmarks."""
