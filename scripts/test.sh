#!/usr/bin/env bash
# Set up everything and run the whole check suite: ruff, mypy, import-linter, pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="$(bash scripts/bootstrap.sh test | tail -n 1)"
bin="$(dirname "$py")"
echo "== ruff"; "$bin/ruff" check .
echo "== mypy (strict: planner, contract)"; "$bin/mypy" --strict planner contract
echo "== mypy (edges)"; "$bin/mypy" partitioner node_agent simulations gpuslice
echo "== import-linter"; "$bin/lint-imports"
echo "== pytest"; "$py" -m pytest -q -p no:cacheprovider "$@"
