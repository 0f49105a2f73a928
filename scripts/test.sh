#!/usr/bin/env bash
# Run the whole test suite: lint, format check, type check, pytest.
# Creates the environment first when it is missing (scripts/setup.sh --install).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --install

.venv/bin/ruff check mlxcel commands tests bench
.venv/bin/ruff format --check mlxcel commands tests bench
.venv/bin/mypy mlxcel commands

set +e
.venv/bin/python -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "mlxcel tests: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$status"
