#!/usr/bin/env bash
# Download the wheels scripts/first_gpu_run.sh installs offline on a GPU machine that cannot reach PyPI.
#
#   scripts/fetch_gpu_wheels.sh [--dir DIR] [--python 3.12] [--cuda]
#
#   --dir DIR       where the wheels go (default: .gpu-wheels, which git ignores)
#   --python X.Y    the GPU machine's Python (default: 3.12)
#   --cuda          also cuda-bindings, cuda-pathfinder and nvidia-cuda-nvrtc (about 64 MB; many CUDA
#                   images already have them, a bare one may not)
#
# By default only libcst (loragen's source tools), which GPU images with torch often lack. Then copy the
# folder along with the checkout to the GPU machine and run scripts/first_gpu_run.sh there.
set -eu
DIR=.gpu-wheels
PY=3.12
CUDA=0
while [ $# -gt 0 ]; do
    case "$1" in
        --dir) DIR=$2; shift 2 ;;
        --python) PY=$2; shift 2 ;;
        --cuda) CUDA=1; shift ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "fetch_gpu_wheels.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
packages=("libcst==1.9.0")  # the version pyproject.toml requires at least
if [ "$CUDA" = 1 ]; then packages+=(cuda-bindings cuda-pathfinder nvidia-cuda-nvrtc); fi
mkdir -p "$DIR"
python3 -m pip download --only-binary=:all: --no-deps --python-version "$PY" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 \
    -d "$DIR" "${packages[@]}"
ls -l "$DIR"
