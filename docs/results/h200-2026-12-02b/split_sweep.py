"""replay_wall with the dense attention's minimum keys per split forced (None: the engine's policy).

    python docs/results/h200-2026-12-02b/split_sweep.py MIN_KEYS [replay_wall.py args...]

The batch-1 steps' dense attention (the target's first layer and the Eagle3 head) splits a ~300-key
context into 64-key pieces plus a combine launch; this measures what larger pieces (fewer splits, 256: none)
do to the whole step's graph replay."""
import runpy
import sys
from pathlib import Path

from m3eagle.attention import triton_backend

keys = None if sys.argv[1] == "None" else int(sys.argv[1])
if keys is not None:
    triton_backend.TritonBackend._min_keys = lambda self, meta: keys
script = Path(__file__).resolve().parents[3] / "benchmarks" / "replay_wall.py"
sys.argv = [str(script), *sys.argv[2:]]
sys.path.insert(0, str(script.parent))
runpy.run_path(str(script), run_name="__main__")
