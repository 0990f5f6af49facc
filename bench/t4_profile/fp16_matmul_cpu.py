"""Why float16 training is slow on a CPU: torch's CPU matmul in fp16, bf16 and fp32 for the three
layouts a linear layer's passes use, at SmolLM2-135M's shapes (640 rows: 4 completions of 160
tokens). Forward is x @ W.T ("NT"); backward's input gradient g @ W ("NN") and weight gradient
g.T @ x ("TN"). A CPU without fp16 arithmetic (no AVX512-FP16: torch says "Float16 arithmetic is
not supported by the CPU") runs fp16 matmuls far slower than fp32 in the backward's layouts, so a
T4's fp16 path on a CPU proves the code, not the speed (docs/recipes/t4.md).

    python bench/t4_profile/fp16_matmul_cpu.py   # ~1 min on 2 cores; ms a matmul, and x fp32
"""
from __future__ import annotations

import time

import torch

SHAPES = [(640, 576, 576), (640, 576, 1536), (640, 1536, 576), (640, 576, 49152)]  # M, K, N


def ms(a: torch.Tensor, b: torch.Tensor, n: int) -> float:
    """Milliseconds a @ b takes, the mean of n after a warm-up."""
    a @ b
    t = time.perf_counter()
    for _ in range(n):
        a @ b
    return (time.perf_counter() - t) / n * 1000


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print(f"{'M x K x N':>18} {'dtype':>9} {'NT (fwd)':>15} {'NN (dx)':>15} {'TN (dW)':>15}")
    for M, K, N in SHAPES:
        base = None
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x, w, g = (torch.randn(M, K, dtype=dtype), torch.randn(N, K, dtype=dtype),
                       torch.randn(M, N, dtype=dtype))
            n = 1 if dtype == torch.float16 and N > 10000 else 3
            got = [ms(x, w.T, n), ms(g, w, n), ms(g.T, x, n)]
            base = base or got
            print(f"{M:>5} x{K:>5} x{N:>6} {str(dtype)[6:]:>9} " + " ".join(
                f"{t:7.1f} ({t / b:5.1f}x)" for t, b in zip(got, base)))


if __name__ == "__main__":
    main()
