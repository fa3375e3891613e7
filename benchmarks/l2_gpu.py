"""Level-2 minibatching on a CUDA device: the default comparison and the real-scale per-step grid, one JSON.

    python benchmarks/l2_gpu.py [--pretrained-encoder DIR] [--out outputs/bench/l2_gpu] [--scale-batch 64]
                                [any l2_minibatching.py option for the comparison, e.g. --task lift --steps 2000]

Runs ``benchmarks/l2_minibatching.py`` twice with ``--device cuda`` (training goes to the GPU through
accelerate): the default comparison (time to the conventional arm's validation loss, per-step grid, closed-loop
success; with ``--pretrained-encoder`` on those frozen towers) and ``--scale-grid`` (So400m-shaped towers under
an action expert of pi0's width, B = ``--scale-batch``). Writes ``<out>/l2_gpu.json`` with both results and the
device's name; the last line printed is ``gpu=<name> time_ratio=<x> memory_ratio=<y> success_ratio=<z>
scale_time_ratio=<a> scale_memory_ratio=<b>``. Exits 2, naming the fix, without a CUDA device. Both figures go
in README.md beside the CPU ones.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "l2_minibatching.py"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pretrained-encoder", default="", help="frozen towers from `vla-rl pretrain-encoder` (a folder)")
    p.add_argument("--out", default="outputs/bench/l2_gpu", help="work and result directory")
    p.add_argument("--scale-batch", type=int, default=64, help="B of the real-scale grid (default: 64)")
    args, comparison_options = p.parse_known_args(argv)  # the rest goes to the comparison (its setting)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: run this on a machine with one (the CPU figures come from l2_minibatching.py)")
        return 2
    out = Path(args.out)
    encoder = ["--pretrained-encoder", args.pretrained_encoder] if args.pretrained_encoder else []
    runs = {
        "comparison": [*encoder, *comparison_options, "--out", str(out / "comparison")],
        "scale": ["--scale-grid", "--scale-batch", str(args.scale_batch), "--out", str(out / "scale")],
    }
    for name, extra in runs.items():
        print(f"== {name}", flush=True)
        subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda", *extra], check=True,
                       env=os.environ | {"MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")})  # fmt: skip
    comparison = json.loads((out / "comparison" / "l2_minibatching.json").read_text())
    scale = json.loads((out / "scale" / "l2_scale.json").read_text())
    top = max(scale["per_step"], key=lambda r: r["copies"])
    result = {"gpu": torch.cuda.get_device_name(0), "comparison": comparison, "scale": scale}
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".l2_gpu.json.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, out / "l2_gpu.json")
    print(f"gpu={result['gpu'].replace(' ', '_')} time_ratio={comparison['time_ratio']:.3f} "
          f"memory_ratio={comparison['memory_ratio']:.3f} success_ratio={comparison['success_ratio']:.3f} "
          f"scale_time_ratio={top['time_ratio']:.3f} scale_memory_ratio={top['memory_ratio']:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
