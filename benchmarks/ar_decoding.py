"""The autoregressive VLA's decoding on this machine: one batched, key-value-cached, constrained decode of 64
observations against 64 sequential batch-1 decodes without a cache, same model, same run.

The same code as `vla-rl bench ar-decoding` (``vla_rl.bench_ar_decoding``, whose docstring states the
protocol and its dated history).

Usage: python benchmarks/ar_decoding.py [--quick=true] [--batch=64] [--device=cuda] [--help]
Writes outputs/bench/ar_decoding/ar_decoding.json; the last line printed is
``decode_speedup=<x> latency_b1_ms=<ms>``.
"""

import sys

from vla_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "ar-decoding", *sys.argv[1:]]))
