"""The routed gate_up on the router's per-token flags (MoEConfig.gate_early) and the shared expert's down in the
gate_up launch (MoEConfig.shared_down) against the installed T = 1 entry, with the tune's own measurement
(`benchmarks/moe_kernel.py`'s tune_shape: the whole layer as the engine runs it, 4 layers per graph replay,
PDL on, median of 30, checked against the reference). Pool: the installed entry (first and last: its spread
in this run), the installed entry with each (gate_early, shared_down) pair, and the gate_early /
shared_down candidates of `candidates`.

    python docs/results/h200-2026-12-01j/sweep_early.py --shapes m3-mini,m3-8b [--write] --json OUT.json
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

PAIRS = ((1, 0), (0, 1), (0, 2), (0, 4), (1, 1), (1, 2), (1, 4))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="m3-mini")
    ap.add_argument("--write", action="store_true", help="install a winning gate_early / shared_down entry for T = 1")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from m3eagle.moe import tuning

    dev, dtype = torch.device("cuda"), torch.bfloat16
    everything = mk.candidates(1, dev)
    out: dict = {"copy_GBps": mk.copy_bandwidth(dev), "best": {}, "rows": []}
    for shape in [s for s in mk.SHAPES if s.name in args.shapes.split(",")]:
        key = tuning.shape_key(shape.experts, shape.hidden, shape.inter, shape.top_k, dtype)
        installed = tuning.get_config(1, shape.experts, shape.hidden, shape.inter, shape.top_k, dtype, dev)
        pool = [installed] + [replace(installed, gate_early=ge, shared_down=sd) for ge, sd in PAIRS]
        pool += [c for c in everything if (c.gate_early or c.shared_down) and c not in pool]
        pool.append(installed)
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
        for r in rows:
            mk.log(f"  {r['us']:8.2f} us ok={r['ok']} {r['config']}")
        if args.write and win is not None and (win.gate_early or win.shared_down):
            mk.write_table(tuning.device_name(dev), {key: {1: win}})
            mk.log(f"  installed {win.to_dict()} for {key} T=1")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
