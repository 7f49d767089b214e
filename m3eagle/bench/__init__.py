"""`m3eagle bench`: the measuring stick -- throughput, per-step cost and the memory roofline.

geometries.py  named model geometries (embedded, m3-mini, m3-8b, tiny) and `--geometry DIR`
roofline.py    bytes per decode step, parameter counts, HBM copy bandwidth
offline.py     the runner: throughput with repeats, steady-state step profile, --compare-hf, table + JSON
"""
