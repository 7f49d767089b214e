"""Several down column tiles per program (MoEConfig.down_rows, `direct._direct_down_rows_kernel`) against
the installed entry, at T = 1, with the tune's own measurement (`benchmarks/moe_kernel.py`'s tune_shape:
the whole layer as the engine runs it, 4 layers per graph replay, PDL on, median of 30, checked against
the reference): its candidates are the installed entry and the down_rows candidates of `candidates`.

    python docs/results/h200-2026-12-01i/sweep_rows.py --shapes m3-mini,m3-8b [--write] --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import moe_kernel as mk  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="m3-mini")
    ap.add_argument("--write", action="store_true", help="install a winning down_rows entry for T = 1")
    ap.add_argument("--block-k", type=int, default=0, help="only down_rows candidates with this gate_up block_k")
    ap.add_argument("--gate-rows", action="store_true", help="only candidates with several gate_up tiles")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from m3eagle.moe import tuning

    dev, dtype = torch.device("cuda"), torch.bfloat16
    everything = mk.candidates(1, dev)
    out: dict = {"copy_GBps": mk.copy_bandwidth(dev), "best": {}, "rows": []}
    for shape in [s for s in mk.SHAPES if s.name in args.shapes.split(",")]:
        key = tuning.shape_key(shape.experts, shape.hidden, shape.inter, shape.top_k, dtype)
        installed = tuning.get_config(1, shape.experts, shape.hidden, shape.inter, shape.top_k, dtype, dev)
        pool = [installed] + [c for c in everything if c.down_rows and c.block_k in (args.block_k or c.block_k,)
                              and (c.gate_rows or not args.gate_rows)]
        pool.append(installed)  # the installed entry first and last: its spread in this run
        mk.candidates = lambda b, d, pool=pool: pool
        layers = [mk.make_layer(shape, dev, dtype, seed=j) for j in range(mk.LAYERS)]
        best, rows = mk.tune_shape(shape, layers, dev, dtype, mk.Timer(dev, 30), (1,))
        out["rows"] += rows
        inst_us = [r["us"] for r in rows if r["config"] == installed.to_dict()]
        win = best.get(1)
        out["best"][shape.name] = {"installed": installed.to_dict(), "installed_us": inst_us,
                                   "best": win.to_dict() if win else None,
                                   "best_us": min(r["us"] for r in rows if r["ok"])}
        mk.log(f"{shape.name} T=1: installed {inst_us} us; best {out['best'][shape.name]['best_us']:.2f} us {win}")
        if args.write and win is not None and win.down_rows:
            mk.write_table(tuning.device_name(dev), {key: {1: win}})
            mk.log(f"  installed {win.to_dict()} for {key} T=1")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
