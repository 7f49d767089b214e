"""m3-8b's installed T = 1 entry (8 warps, gate_up 2 x 512 x 2 tiles, down 1 x 2048 x 4 tiles, shared_down 2)
against its own twins with shared_down 0 / 1 / 4, with the tune's measurement (`benchmarks/moe_kernel.py`'s
tune_shape: the whole layer as the engine runs it, 4 layers per PDL graph replay, median of 30, checked
against the reference). The installed entry runs first and last (its spread in this run). Writes nothing.

    python docs/results/h200-2026-12-01k/sweep_8b.py --json OUT.json
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
    ap.add_argument("--shapes", default="m3-8b")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from m3eagle.moe import tuning

    dev, dtype = torch.device("cuda"), torch.bfloat16
    out: dict = {"copy_GBps": mk.copy_bandwidth(dev), "rows": []}
    for shape in [s for s in mk.SHAPES if s.name in args.shapes.split(",")]:
        installed = tuning.get_config(1, shape.experts, shape.hidden, shape.inter, shape.top_k, dtype, dev)
        pool = [installed] + [replace(installed, shared_down=sd) for sd in (0, 1, 4) if sd != installed.shared_down]
        pool.append(installed)
        mk.candidates = lambda b, d, pool=pool: pool
        layers = [mk.make_layer(shape, dev, dtype, seed=j) for j in range(mk.LAYERS)]
        _, rows = mk.tune_shape(shape, layers, dev, dtype, mk.Timer(dev, 30), (1,))
        out["rows"] += rows
        mk.log(f"{shape.name} T=1, installed {installed.to_dict()}")
        for r in rows:
            mk.log(f"  {r['us']:8.2f} us ok={r['ok']} shared_down={r['config'].get('shared_down', 0)}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
