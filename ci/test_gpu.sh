#!/usr/bin/env bash
# The GPU tests (pytest -m gpu) on a machine where ci/build_gpu.sh ran. Extra arguments go to pytest.
# With $OUT set, the log, a JUnit XML file and nvidia-smi's view of the device are written there.
# If the SGLang device bundle was carried along (.carry/sglang), it is activated first; if pytest is
# missing (the GPU machine has no network), it is installed from carried wheels in .whl/ (pytest,
# pluggy, iniconfig: `pip download --only-binary=:all: --python-version 3.12 -d .whl pytest`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-python3}

if [ -f .carry/sglang/activate ]; then
  # shellcheck disable=SC1091
  source .carry/sglang/activate
fi

if ! "$python" -c "import pytest" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/kdtree-pytest .whl/*.whl
    export PYTHONPATH="/tmp/kdtree-pytest${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "ci/test_gpu.sh: pytest is not installed and no wheels were carried in .whl/" >&2
    exit 1
  fi
fi

args=(-m gpu tests -ra "$@")
rc=0
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
  "$python" -m pytest "${args[@]}" --junitxml="$OUT/pytest-gpu.xml" 2>&1 | tee "$OUT/pytest-gpu.log" || rc=${PIPESTATUS[0]}
else
  "$python" -m pytest "${args[@]}" || rc=$?
fi
if [ "$rc" -eq 5 ]; then
  echo "ci/test_gpu.sh: no GPU test was collected" >&2
  exit 1
fi
exit "$rc"
