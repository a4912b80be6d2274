"""Groups `perf report --no-children --sort symbol -g none --stdio` lines (read from stdin)
into the categories of a training step and prints each one's share of the samples, largest
first. Used by tools/profile_gpt_step.sh."""
import re
import sys

# First match wins: the order puts specific names before general ones.
CATEGORIES = [
    ("matmul (gemm)", r"gemm"),
    ("fused: gelu", r"kernels::gelu"),
    ("fused: layer_norm", r"kernels::layer_norm"),
    ("fused: softmax", r"kernels::softmax"),
    ("fused: cross_entropy", r"kernels::cross_entropy"),
    ("fused: bias", r"kernels::bias"),
    ("fused: attention (softmax part)", r"kernels::attention"),
    ("fused: exp", r"kernels::exp"),
    ("fused: linear (outside gemm)", r"kernels::linear"),
    ("optimizer", r"kernels::adam|kernels::sgd|nn::optim"),
    ("other fused kernels", r"pipewright::kernels"),
    ("allocation, page faults, zeroing", r"clear_page|page_fault|do_anonymous|memset|malloc|"
     r"_int_free|cfree|sysmalloc|\[k\].*(mm|pte|lru|memcg|folio|zone|page)"),
    ("copies", r"memmove|memcpy|copy_strided|copy2d|Tensor::contiguous|cat"),
    ("libm (exp, tanh, pow, log)", r"expm1f|powf|tanhf|expf|logf|__exp|__log|__tanh"),
    ("candle element-wise, reductions", r"binary_map|unary_map|Map1|Map2|Reduce|reduce|affine|"
     r"WCond|where_cond|IndexSelect|Gather|ScatterAdd|IndexAdd|cmp|cpu_backend"),
    ("thread pool (rayon, barriers, spinning)", r"rayon|BarrierPool|trampoline|sched_yield|"
     r"futex|crossbeam|\[k\].*(schedule|switch|wake|sched)"),
]


def main():
    totals = {}
    for line in sys.stdin:
        m = re.match(r"\s*([\d.]+)%\s+(\[.\])\s+(.*)", line)
        if not m:
            continue
        pct, kind, sym = float(m.group(1)), m.group(2), m.group(3).strip()
        name = f"{kind} {sym}"
        cat = next((c for c, rx in CATEGORIES if re.search(rx, name)), "rest")
        totals[cat] = totals.get(cat, 0.0) + pct
    for cat, pct in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"{pct:6.1f}%  {cat}")


if __name__ == "__main__":
    main()
