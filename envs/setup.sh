#!/usr/bin/env bash
# Create .venv with everything the workflow and the tests need, pinned by
# requirements/constraints.txt. torch is installed FIRST and pinned, so pip never
# pulls a multi-GB CUDA build on a CPU machine. GPU users: set TORCH_SPEC, e.g.
#   TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>" bash envs/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC2086
"$VENV/bin/pip" install -q --disable-pip-version-check $TORCH_SPEC
"$VENV/bin/pip" install -q --disable-pip-version-check -c requirements/constraints.txt -e ".[workflow,test]"
"$VENV/bin/pip" check
echo "environment ready: $VENV ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
