#!/usr/bin/env bash
# Set up everything and run the main job on its embedded default workload and cluster.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/bootstrap.sh" | tail -n 1)"
exec "$(dirname "$py")/gpuslice" "${@:-simulate}"
