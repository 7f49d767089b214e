"""m3-8b T = 1: does shared_down (MoEConfig.shared_down) win on its own? The same 8-warp rows config with
shared_down 0 / 2 / 4, in that order three times, and the entry installed before call1 first and last
(tune_shape's timing: 4 layers per PDL graph replay, median of 30).

    python docs/results/h200-2026-12-01j/ab_shared_down.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import moe_kernel as mk  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from m3eagle.moe.tuning import MoEConfig

    dev, dtype = torch.device("cuda"), torch.bfloat16
    shape = next(s for s in mk.SHAPES if s.name == "m3-8b")
    old = MoEConfig(16, 2, 1024, num_warps=4, num_stages=1, direct=1, down_block_n=1, down_block_k=2048,
                    down_preload=1, route_shared=1)
    rows8 = MoEConfig(16, 2, 512, num_warps=8, num_stages=1, direct=1, down_block_n=1, down_block_k=2048,
                      down_preload=1, route_shared=1, down_rows=4, gate_rows=2)
    pool = [old] + [replace(rows8, shared_down=sd) for _ in range(3) for sd in (0, 2, 4)] + [old]
    mk.candidates = lambda b, d: pool
    layers = [mk.make_layer(shape, dev, dtype, seed=j) for j in range(mk.LAYERS)]
    _, rows = mk.tune_shape(shape, layers, dev, dtype, mk.Timer(dev, 30), (1,))
    for r in rows:
        mk.log(f"  {r['us']:8.2f} us ok={r['ok']} {r['config']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
