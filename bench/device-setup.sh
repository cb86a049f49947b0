#!/usr/bin/env bash
# On the H200 (device tool), from the repo root, before any bench/h200.sh stage:
#   export PYTHONPATH=/tmp/site; bash bench/device-setup.sh && bash bench/h200.sh STAGE...
# The device image has torch, triton, transformers, httpx, prometheus-client, yaml, rich and tqdm but
# not pydantic or the server's packages: they travel as wheels in the gitignored .whl/ (carry it),
# fetched here on the dev machine for the device's Python (3.12, x86-64):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d .whl pydantic pydantic-core annotated-types typing-inspection \
#     typing-extensions fastapi starlette uvicorn opentelemetry-api
# (one version of each; pydantic pins pydantic-core exactly). Then the project, editable, no deps.
set -euo pipefail
[ -n "$(ls .whl/*.whl 2>/dev/null)" ] || { echo "device-setup: no wheels in .whl/ (carry .whl)" >&2; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
PYTHONPATH=/tmp/site python3 -c "import anneal.engine.llm, anneal.engine.server, pydantic; print('device-setup: ok, pydantic', pydantic.VERSION)"
