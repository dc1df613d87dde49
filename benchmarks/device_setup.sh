#!/usr/bin/env bash
# Source this on the GPU machine (which has torch, triton and transformers but no msgspec/pyzmq):
# it installs the wheels carried in .whl/ (see README, "Benchmarks on a GPU") into /tmp/site, and
# makes this checkout importable as `minivllm` (a link named so; nothing is built or installed).
if compgen -G ".whl/*.whl" > /dev/null; then  # (a later call on a warm machine may carry none)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
mkdir -p /tmp/minivllm-path && ln -sfn "$(pwd)" /tmp/minivllm-path/minivllm
export PYTHONPATH=/tmp/site:/tmp/minivllm-path${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
