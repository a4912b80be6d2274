#!/usr/bin/env bash
# Runs a command built by tools/build-cuda.sh on a GPU machine whose CUDA libraries are the
# NVIDIA wheels of its Python (PyTorch's): candle's CUDA backend links cuBLAS, cuBLASLt, cuRAND
# and NVRTC, and NCCL comes with them; the loader finds the driver's libcuda by itself.
#
#   tools/run-on-gpu.sh target/cuda/release/pipewright train --device cuda --out runs/gpu
#
# PYTHON names the Python whose site-packages hold the wheels (default python3).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: tools/run-on-gpu.sh COMMAND [ARGS...]" >&2; exit 2; }
dirs=$("${PYTHON:-python3}" - <<'PY'
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
libs = ["libcublas.so", "libcublasLt.so", "libcurand.so", "libnvrtc.so", "libnccl.so", "libcudart.so"]
found = []
for root in roots:
    for lib in libs:
        for path in sorted(glob.glob(os.path.join(root, "nvidia", "**", lib + ".*"), recursive=True)):
            if os.path.dirname(path) not in found:
                found.append(os.path.dirname(path))
print(":".join(found))
PY
)
if [ -z "$dirs" ]; then
  echo "run-on-gpu: ${PYTHON:-python3} has no NVIDIA CUDA wheels (cuBLAS, NCCL, ...) in its" \
    "site-packages: install PyTorch with CUDA or the nvidia-* wheels, or set PYTHON" >&2
  exit 1
fi
export LD_LIBRARY_PATH=$dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
exec "$@"
