"""Experiment shim (not committed): OLD_ALIGN=1 runs a script / module with the previous commit's alignment
(m3eagle/moe/_old_align.py: the shared expert as a one-hot column) patched into triton_moe."""
import os
import runpy
import sys

import m3eagle.moe.triton_moe as tm

if os.environ.get("OLD_ALIGN") == "1":
    from m3eagle.moe import _old_align

    tm.align = _old_align.align
if os.environ.get("FUSE_MAX_T"):
    tm.COMBINE_FUSE_MAX_T = int(os.environ["FUSE_MAX_T"])
print(f"ab_shim: align from {tm.align.__module__}, COMBINE_FUSE_MAX_T {tm.COMBINE_FUSE_MAX_T}", file=sys.stderr)
target, sys.argv = sys.argv[1], sys.argv[1:]
if target == "-m":
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    runpy.run_path(target, run_name="__main__")
