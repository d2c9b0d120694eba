#!/usr/bin/env bash
# Session 55: a triton release small enough to travel to the device in one call with the tree
# (the device tool's 64 MiB). The 3.8.0 wheel unpacks to 897 MB, most of it libtriton.so's debug
# information (483 MB, 192 MB stripped), cupti (278 MB; the proton profiler's) and the Blackwell
# ptxas (47 MB): without them, xz -9 makes 54.6 MB of it (bench/NOTES.md entry 109). Stripped,
# the Python 3.11 build compiled the preset's 133 kernels for sm_90 here (compile_check --preset)
# and this script's 3.12 build (the device's Python) a kernel under Python 3.12 with its ptxas.
#   bash bench/results/sweeps/session55-pack-triton.sh 3.8.0 .t38s    # about 2 minutes on 2 cores
# then on the device (carry .t38s and .whl):
#   mkdir -p /tmp/t38x && xz -d -T0 < .t38s/triton.tar.xz | tar x -C /tmp/t38x
#   PYTHONPATH=/tmp/t38x:.:/tmp/site python3 ...
set -euo pipefail
version=${1:?triton version, e.g. 3.8.0}
dest=${2:?folder for the tarball, ignored by git (.git/info/exclude)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT  # also when a step fails
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$work/wheel" "triton==$version"
# unzip, not pip install --target: this machine's Python need not be the device's (3.12)
unzip -q "$work"/wheel/*.whl -d "$work/pkg"
strip --strip-unneeded "$work/pkg/triton/_C/libtriton.so"
mkdir -p "$dest"
(cd "$work/pkg" && tar c --exclude='triton/backends/nvidia/lib/cupti*' \
  --exclude='triton/backends/nvidia/bin/ptxas-blackwell' --exclude='triton/_C/libproton.so' \
  --exclude=__pycache__ triton "triton-$version.dist-info") | xz -9 -T0 >"$dest/triton.tar.xz"
ls -l "$dest/triton.tar.xz"
