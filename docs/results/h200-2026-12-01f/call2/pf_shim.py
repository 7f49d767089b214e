"""Experiment shim (not committed): run a script / module with PDL weight prefetch only in the modules named
by PF_MODULES (comma list of direct, triton_moe, gemv, triton_fused); the others get PDL = WAIT."""
import os
import runpy
import sys
import types

import m3eagle.fused.gemv as g
import m3eagle.fused.triton_fused as tf
import m3eagle.moe.direct as d
import m3eagle.moe.triton_moe as tm
from m3eagle import pdl as real

which = {m for m in os.environ.get("PF_MODULES", "").split(",") if m}


def make(prefetch: bool):
    shim = types.ModuleType("pdl_shim")
    shim.__dict__.update({k: v for k, v in real.__dict__.items() if not k.startswith("__")})

    def args(t):
        if real.enabled(t.device):
            return {"PDL": real.PREFETCH if prefetch else real.WAIT, "launch_pdl": True}
        return {"PDL": 0}

    shim.args = args
    return shim


for name, mod in (("direct", d), ("triton_moe", tm), ("gemv", g), ("triton_fused", tf)):
    mod.pdl = make(name in which)
print(f"pf_shim: prefetch in {sorted(which)}", file=sys.stderr)
target, sys.argv = sys.argv[1], sys.argv[1:]
if target == "-m":
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    runpy.run_path(target, run_name="__main__")
