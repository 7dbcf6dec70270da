"""Fused vs reference attention kernel, forward + backward, on this machine's default device.

Run: `PYTHONPATH=src python benchmarks/attention_kernel.py`. Prints one JSON object per size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from orangetron.model import attention_kernel

SEQ_LENS = (256, 1024)
BATCH, HEADS, HEAD_DIM = 1, 4, 64


def fwd_bwd_ms(impl: str, seq_len: int, device: torch.device, repeats: int) -> float:
    """Median wall time of one causal forward + backward, in milliseconds."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(BATCH, seq_len, HEADS, HEAD_DIM, generator=gen).to(device).requires_grad_()
        for _ in range(3)
    )
    d_out = torch.randn(BATCH, seq_len, HEADS, HEAD_DIM, generator=gen).to(device)

    def step() -> None:
        out, _ = attention_kernel(q, k, v, causal=True, impl=impl)
        torch.autograd.grad(out, (q, k, v), d_out)
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up: first-call dispatch and allocation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for seq_len in SEQ_LENS:
        repeats = 20 if seq_len <= 256 else 7
        fused = fwd_bwd_ms("fused", seq_len, device, repeats)
        reference = fwd_bwd_ms("reference", seq_len, device, repeats)
        config = {"device": device.type, "dtype": "float32", "batch": BATCH, "heads": HEADS,
                  "head_dim": HEAD_DIM, "seq_len": seq_len, "causal": True,
                  "threads": torch.get_num_threads(), "repeats": repeats}
        print(json.dumps({"name": "attention_kernel", "config": config, "metric": "fwd_bwd_ms",
                          "value": round(fused, 3), "unit": "ms", "baseline": round(reference, 3),
                          "ratio": round(reference / fused, 3)}), flush=True)


if __name__ == "__main__":
    main()
