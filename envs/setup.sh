#!/usr/bin/env bash
# Create .venv with everything the workflow and the tests need, pinned by
# requirements/constraints.txt (runtime) and requirements/dev-constraints.txt (tests, lint).
# torch is installed FIRST and then pinned, so nothing else resolves it anew. Which build
# `torch==2.13.0` gives depends on where pip looks: on our CI machines a CPU wheel lies on
# local disk and is taken; on an ordinary Linux box PyPI's torch wheel is the multi-GB CUDA
# build. So:
#   CPU machine elsewhere: TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" bash envs/setup.sh
#   GPU machine:           TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126" bash envs/setup.sh
#   (or install the package into an environment that already has torch:
#    pip install -c requirements/constraints.txt -e ".[workflow]" after removing its torch line)
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
"$VENV/bin/pip" install -q --disable-pip-version-check -c requirements/constraints.txt -c requirements/dev-constraints.txt \
    -e ".[workflow,test]"
"$VENV/bin/pip" check
echo "environment ready: $VENV ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
