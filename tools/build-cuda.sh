#!/usr/bin/env bash
# Builds pipewright for NVIDIA GPUs (cargo feature `cuda`) on a machine with no GPU and no CUDA
# installed, as ../shared/GPU.md found it works:
#  1. a venv ($PIPEWRIGHT_CUDA_ENV, default ~/.cache/pipewright-cuda-env) with nvcc and its
#     compiler parts pinned to CUDA 13.0, the driver of the lent H100/H200 machines (newer nvcc
#     writes PTX that driver cannot load), the cccl headers, and the CUDA libraries' wheels;
#  2. a link-only libcuda.so: every driver function cudarc declares, each returning an error
#     (no wheel ships libcuda; the GPU machine's real driver is what loads at run time);
#  3. cargo with candle's kernels compiled for compute capability $CUDA_COMPUTE_CAP (default 90:
#     H100 and H200), into target/cuda so the CPU build in target/ is kept.
#
#   tools/build-cuda.sh                 target/cuda/release/pipewright (about 40 MB)
#   tools/build-cuda.sh clippy          the CUDA build's lints, as .ci/run lints the others
#   tools/build-cuda.sh cargo ARGS...   any cargo command in the same environment
#
# tools/run-on-gpu.sh runs the binary on the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."

env_dir=${PIPEWRIGHT_CUDA_ENV:-$HOME/.cache/pipewright-cuda-env}
wheels=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-cccl==13.0.85 nvidia-nvvm==13.0.88
  nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-nvrtc==13.0.88
  nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 nvidia-nccl-cu13==2.27.7)
if [ "$(cat "$env_dir/.wheels" 2>/dev/null)" != "${wheels[*]}" ]; then
  [ -x "$env_dir/bin/python" ] || python3 -m venv "$env_dir"
  "$env_dir/bin/pip" install -q --disable-pip-version-check "${wheels[@]}"
  echo "${wheels[*]}" > "$env_dir/.wheels"
fi
nvidia=$("$env_dir/bin/python" -c 'import nvidia; print(list(nvidia.__path__)[0])')
cu13=$nvidia/cu13

# The folder the linker searches: the stub driver and unversioned names for the wheels' libraries.
link=$env_dir/link
mkdir -p "$link"
cargo fetch -q
cudarc=$(cargo metadata --format-version 1 --all-features | "$env_dir/bin/python" -c '
import json, sys
print(next(p["manifest_path"] for p in json.load(sys.stdin)["packages"] if p["name"] == "cudarc"))')
driver=$(dirname "$cudarc")/src/driver/sys/mod.rs
if [ ! -f "$link/libcuda.so" ] || [ "$driver" -nt "$link/libcuda.so" ]; then
  grep -oE 'pub unsafe fn cu[A-Za-z0-9_]+\(' "$driver" | sed -E 's/pub unsafe fn (cu[A-Za-z0-9_]+)\(/\1/' |
    sort -u | awk '{ printf "int %s(void) { return 999; /* CUDA_ERROR_UNKNOWN */ }\n", $1 }' > "$link/cuda_stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$link/libcuda.so" "$link/cuda_stub.c"
fi
for lib in "$cu13"/lib/libcublas.so.* "$cu13"/lib/libcublasLt.so.* "$cu13"/lib/libcurand.so.* \
  "$cu13"/lib/libnvrtc.so.13 "$cu13"/lib/libcudart.so.* "$nvidia"/nccl/lib/libnccl.so.*; do
  ln -sf "$lib" "$link/$(basename "$lib" | sed -E 's/\.so\..*/.so/')"
done

export PATH=$cu13/bin:$PATH CUDA_ROOT=$cu13 CUDA_PATH=$cu13 CUDA_HOME=$cu13 NVCC=$cu13/bin/nvcc
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90} CUDARC_CUDA_VERSION=13000
export LIBRARY_PATH=$link${LIBRARY_PATH:+:$LIBRARY_PATH}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}

case "${1:-build}" in
  build) cargo build --release -p pipewright-cli --features cuda
    ls -l "$CARGO_TARGET_DIR/release/pipewright" ;;
  clippy) cargo clippy --release --all-targets --features pipewright/cuda,pipewright-models/cuda,pipewright-cli/cuda -- -D warnings ;;
  cargo) shift; cargo "$@" ;;
  *) echo "usage: tools/build-cuda.sh [build | clippy | cargo ARGS...]" >&2; exit 2 ;;
esac
