#!/usr/bin/env bash
# Source this on the GPU machine (which has torch, triton and transformers but no msgspec/pyzmq):
# it installs the wheels carried in .whl/ (see README, "Benchmarks on a GPU") into /tmp/site.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$(pwd)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
