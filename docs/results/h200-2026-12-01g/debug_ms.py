"""Which engines agree on the multi-step GPU test's requests (seeded sampling, arrivals): graph / eager,
one step / four per iteration, PDL auto / off. One line per engine: its first divergence from the first."""
import os
import sys

sys.path.insert(0, "tests")
from test_cuda_graphs import make, params, run_with_arrivals  # noqa: E402

for k in (0, 3):
    for sampled in (True, False):
        res = {}
        for name, eager, steps, pdl in [("one-graph", False, 1, "auto"), ("multi-graph", False, 4, "auto"),
                                        ("one-eager", True, 1, "auto"), ("multi-eager", True, 4, "auto"),
                                        ("one-graph-pdl0", False, 1, "0"), ("multi-graph-pdl0", False, 4, "0")]:
            os.environ["M3EAGLE_PDL"] = pdl
            llm = make(k, True, eager, num_scheduler_steps=steps)
            res[name] = run_with_arrivals(llm, params(sampled))
            e = llm.engine
            base = res["one-graph"]
            diff = [(i, next(j for j, (a, b) in enumerate(zip(x, y)) if a != b) if x[:len(y)] != y[:len(x)] else
                     min(len(x), len(y))) for i, (x, y) in enumerate(zip(res[name], base)) if x != y]
            print(f"K={k} sampled={sampled} {name}: iterations {e.num_iterations} steps {e.num_steps}; "
                  f"differs from one-graph at (request, token) {diff}", flush=True)
            del llm
