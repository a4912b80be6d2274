"""The matrix products of crates/pipewright-models/benches/matmul.rs in PyTorch (MKL) and NumPy
(OpenBLAS), same shapes and layouts, median of 5 after a warm-up, 2 threads (TORCH_THREADS):
prints each library's flop-weighted GFLOP/s."""
import os
import time

threads = os.environ.get("TORCH_THREADS", "2")
os.environ.setdefault("OPENBLAS_NUM_THREADS", threads)
import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(threads))
SHAPES = [(2048, 512, 1536, False, False), (2048, 512, 2048, False, False),
          (2048, 2048, 512, False, False), (2048, 512, 4096, False, True),
          (2048, 2048, 512, False, True), (512, 2048, 2048, True, False),
          (2048, 4096, 512, False, False), (4096, 2048, 512, True, False)]


def operand(rows, cols, transposed, lib):
    if lib == "torch":
        return torch.randn(cols, rows).t() if transposed else torch.randn(rows, cols)
    x = np.random.randn(cols, rows).astype(np.float32)
    return x.T if transposed else np.random.randn(rows, cols).astype(np.float32)


for lib in ["torch", "numpy"]:
    flops = secs = 0.0
    for m, k, n, ta, tb in SHAPES:
        a, b = operand(m, k, ta, lib), operand(k, n, tb, lib)
        a @ b
        times = []
        for _ in range(5):
            s = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - s)
        times.sort()
        flops += 2.0 * m * k * n
        secs += times[2]
    name = "torch_mkl" if lib == "torch" else "numpy_openblas"
    print(f"{name}_gflops {flops / secs / 1e9:.0f}")
