#!/usr/bin/env bash
# The README's test command, in the active environment (after ci/install.sh). Extra arguments go to
# pytest. Exit 5 (no test collected) is a failure here, never a silent pass.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rc=0
python -m pytest -q tests "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
  echo "ci/test.sh: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
