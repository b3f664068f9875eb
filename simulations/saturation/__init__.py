"""The saturation protocol (FGD's: pods sampled to 130 % of capacity, arrivals only) for
GPU-share policies and for partitioned modes through the production planner, with the
fragmentation measure and the MIG geometry bound."""
