#!/usr/bin/env bash
# Ray for the GPU machine, whose image has no Ray and whose `run` carries at most 64 MiB per call.
#
# Here (any machine with pip and the internet):
#   bash benchmarks/ray_wheel.sh            # -> .ray-wheel/ (gitignored)
# fetches Ray (the version installed here, or $RAY_VERSION) and its dependencies as CPython 3.12
# manylinux x86_64 wheels, and cuts the Ray wheel (~76 MiB) into parts of $PART_MIB (40) MiB:
#   .ray-wheel/deps/      the dependency wheels, RAY_WHEEL (the wheel's name) and its SHA256
#   .ray-wheel/part00, part01, ...
# On the device (after each part has come over in a call of its own, see benchmarks/RESULTS.md):
#   bash benchmarks/ray_wheel.sh --install DIR   # DIR holds deps/ and every part
# joins the parts, checks the SHA256, and installs Ray and its dependencies into /tmp/site (where
# benchmarks/device_setup.sh puts the other wheels, on its PYTHONPATH).
set -euo pipefail

if [[ "${1:-}" == "--install" ]]; then
    dir=${2:?usage: ray_wheel.sh --install DIR}
    name=$(cat "$dir/deps/RAY_WHEEL")
    cat "$dir"/part* > "$dir/deps/$name"
    (cd "$dir/deps" && sha256sum -c RAY_WHEEL.sha256)
    # Ray, and those of its dependencies the image lacks (the image's own torch / transformers
    # stacks keep their versions of requests, packaging, ...: /tmp/site comes first on the path).
    mapfile -t wheels < <(python3 - "$dir/deps" <<'PY'
import importlib.metadata as metadata, os, sys
folder = sys.argv[1]
for name in sorted(os.listdir(folder)):
    if not name.endswith(".whl"):
        continue
    try:
        if name.startswith("ray-"):
            raise metadata.PackageNotFoundError
        metadata.distribution(name.split("-")[0])
    except metadata.PackageNotFoundError:
        print(os.path.join(folder, name))
PY
)
    echo "installing ${#wheels[@]} wheel(s): ${wheels[*]##*/}"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "${wheels[@]}"
    PYTHONPATH=/tmp/site python3 -c "import ray; print('ray', ray.__version__, 'installed in /tmp/site')"
    exit 0
fi

version=${RAY_VERSION:-$(python3 -c 'import ray; print(ray.__version__)')}
out=${1:-.ray-wheel}
part_mib=${PART_MIB:-40}
rm -rf "$out"
mkdir -p "$out/deps"
python3 -m pip download -q "ray==$version" --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --platform manylinux2014_x86_64 -d "$out/deps"
wheel=$(cd "$out/deps" && ls ray-"$version"-*.whl)
(cd "$out/deps" && sha256sum "$wheel" > RAY_WHEEL.sha256 && echo "$wheel" > RAY_WHEEL)
split -b "${part_mib}M" -d -a 2 "$out/deps/$wheel" "$out/part"
rm "$out/deps/$wheel"
du -sh "$out"/deps "$out"/part*
