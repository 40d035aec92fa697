#!/usr/bin/env bash
# Fill ./.whl/ (git-ignored) with the wheels the GPU machine lacks, so benchmarks can import
# DeepSpeed and shardwise there. The GPU machine has no network; it installs these with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
#
# Idempotent: a wheel already in .whl/ is not fetched or built again. Re-run after changing a
# version below; stale versions of the same package are removed, because two versions of one
# package make that --no-deps install fail.
#
# Why these packages: deepspeed's Requires-Dist is einops, hjson, msgpack, ninja, numpy,
# packaging, psutil, py-cpuinfo, pydantic>=2, torch, tqdm. The device image already has all of
# them except hjson and pydantic (and pydantic's own needs). typing-extensions is in the image,
# but pydantic 2.13 needs >=4.14.1, so a recent one travels too; it shadows the image's copy for
# every import, which is fine because newer typing-extensions stays backward compatible
# (torch 2.11 and transformers 5.17 need only >=4.10). torchao (see BINARY_PINS) is optional
# for shardwise; it travels so the fp8 benchmarks and GPU tests can run there.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHL_DIR="${WHL_DIR:-$REPO_ROOT/.whl}"
DEEPSPEED_VERSION="${DEEPSPEED_VERSION:-0.19.8}"
PYTHON="${PYTHON:-python3}"

# One pinned version each, cp312 manylinux for the device's Python 3.12 on x86-64.
# pydantic 2.13.4 pins pydantic-core 2.46.4 exactly; keep them in step.
BINARY_PINS=(
    "hjson==3.1.0"
    "pydantic==2.13.4"
    "pydantic-core==2.46.4"
    "annotated-types==0.7.0"
    "typing-inspection==0.4.2"
    "typing-extensions==4.16.0"
    # torchao for the "fp8" section (float8 training is pure Python over torch._scaled_mm).
    # 0.17.0 is the release built against torch 2.11 (the device's torch; its __init__ loads
    # its optional .so kernels only for torch >= 2.11). The wheel declares no torch
    # requirement, so the --no-deps install never brings a torch wheel.
    "torchao==0.17.0"
)

PLATFORM_ARGS=(
    --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
    --platform manylinux1_x86_64
)

mkdir -p "$WHL_DIR"

# Wheel file names normalise '-' to '_' in the distribution name.
wheel_prefix() { echo "${1//-/_}"; }

# Remove any other version of NAME so only VERSION stays (two versions break the install).
drop_other_versions() {
    local name="$1" version="$2" prefix f
    prefix="$(wheel_prefix "$name")"
    shopt -s nullglob nocaseglob
    for f in "$WHL_DIR"/"$prefix"-*.whl; do
        case "$(basename "$f")" in
            "$prefix-$version-"*) ;;
            *) echo "removing stale $(basename "$f")"; rm -f "$f" ;;
        esac
    done
    shopt -u nullglob nocaseglob
}

have_wheel() {
    local prefix="$1" version="$2"
    shopt -s nullglob nocaseglob
    local matches=("$WHL_DIR"/"$prefix"-"$version"-*.whl)
    shopt -u nullglob nocaseglob
    [ "${#matches[@]}" -gt 0 ]
}

for pin in "${BINARY_PINS[@]}"; do
    name="${pin%%==*}"
    version="${pin##*==}"
    drop_other_versions "$name" "$version"
    if have_wheel "$(wheel_prefix "$name")" "$version"; then
        echo "have $pin"
        continue
    fi
    echo "downloading $pin"
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: "${PLATFORM_ARGS[@]}" \
        -d "$WHL_DIR" "$pin"
done

# DeepSpeed: build a pure-Python wheel from the sdist. DS_BUILD_OPS=0 compiles nothing here;
# its C++/CUDA sources ship inside the wheel and JIT-build on the GPU machine (ninja and nvcc
# are there). The build imports torch, so it runs with --no-build-isolation against the
# torch installed here.
drop_other_versions deepspeed "$DEEPSPEED_VERSION"
if have_wheel deepspeed "$DEEPSPEED_VERSION"; then
    echo "have deepspeed==$DEEPSPEED_VERSION"
else
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    echo "downloading deepspeed==$DEEPSPEED_VERSION sdist"
    if ! "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$work" \
            "deepspeed==$DEEPSPEED_VERSION"; then
        echo "deepspeed==$DEEPSPEED_VERSION not found; taking the newest sdist pip gives"
        "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$work" deepspeed
    fi
    sdist="$(ls "$work"/deepspeed-*.tar.gz)"
    echo "building wheel from $(basename "$sdist")"
    DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$work/out" "$sdist"
    built="$(ls "$work"/out/deepspeed-*.whl)"
    built_version="$(basename "$built" | cut -d- -f2)"
    drop_other_versions deepspeed "$built_version"
    cp "$built" "$WHL_DIR/"
fi

echo "--- $WHL_DIR"
ls -la "$WHL_DIR"
du -sh "$WHL_DIR"
