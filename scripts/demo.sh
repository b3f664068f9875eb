#!/usr/bin/env bash
# Set up everything and run the main job on its embedded default workload and cluster.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# the sim extra: the main job is `gpuslice simulate` (numpy, matplotlib)
py="$(bash "$root/scripts/bootstrap.sh" sim | tail -n 1)"
exec "$(dirname "$py")/gpuslice" "${@:-simulate}"
