"""Which launches of a replayed step cost its time? Each kernel's increment on the critical path. (GPU only)

    python benchmarks/critical_path.py [--k 0,3] [--replays 30] [--top 0]

Under PDL a kernel starts before its predecessor ends and waits inside, so its profiled duration says
little; what it adds to the step is end(i) - end(i - 1) (the step's kernels run one after another on one
stream). For the embedded pair's batch-1 bucket graph (steady state, real inputs), this replays the graph
--replays times under the profiler and prints, per position in the step, the kernel's name and the median
of that increment, marking the draft head's part (everything after the step's verification launch), then
the sums per kernel name and per part. One JSON line per K at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m3eagle import LLM, SamplingParams  # noqa: E402
from m3eagle.engine.graph_runner import bucket_for  # noqa: E402


def kernels(graph: torch.cuda.CUDAGraph, replays: int) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every kernel / copy of `replays` replays, in start order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    ev = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"]
          if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(ev, key=lambda e: e[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", default="0,3")
    ap.add_argument("--replays", type=int, default=30)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("critical_path.py needs a CUDA device")
    for k in (int(x) for x in a.k.split(",")):
        llm = LLM(device="cuda", num_draft_tokens=k, max_num_seqs=32, max_model_len=4096)
        eng = llm.engine
        sp = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
        rid = eng.add_request(llm.encode("def f(x):\n    return x + 1\n"), sp, stream_text=False).request_id
        for _ in range(40):
            eng.step()
        torch.cuda.synchronize()
        key = next(key for key in eng.graphs.graphs if key[0] == bucket_for(1, eng.graphs.buckets))
        graph = eng.graphs.graphs[key][0]
        for _ in range(5):
            graph.replay()
        ev = kernels(graph, a.replays)
        n = len(ev) // a.replays
        steps = [ev[i * n:(i + 1) * n] for i in range(a.replays)]
        names = [e[0] for e in steps[0]]
        assert all([e[0] for e in s] == names for s in steps), "replays differ in their kernel sequence"
        # increment of position i: end(i) - end(i - 1); position 0: from the previous replay's last end
        inc = [[s[i][2] - (s[i - 1][2] if i else prev[-1][2]) for s, prev in zip(steps[1:], steps[:-1])]
               for i in range(n)]
        med = [statistics.median(x) for x in inc]
        dur = [statistics.median(s[i][2] - s[i][1] for s in steps) for i in range(n)]
        split = max((i for i, nm in enumerate(names) if "accept" in nm), default=n - 1) + 1 if k else n
        print(f"K={k} batch 1: {n} kernels per step, step {sum(med):.2f} us (sum of increments)")
        by_name: dict[tuple[str, str], list[float]] = defaultdict(list)
        for i, (nm, m, d) in enumerate(zip(names, med, dur)):
            part = "draft" if i >= split else "target"
            by_name[(part, nm.split("(")[0][:40])].append(m)
            print(f"  {i:3d} {part:6s} {m:6.2f} us  (dur {d:6.2f})  {nm[:70]}")
        print("  per part and kernel: total us / count / mean")
        for (part, nm), xs in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
            print(f"    {part:6s} {sum(xs):7.2f} {len(xs):4d} {sum(xs) / len(xs):6.2f}  {nm}")
        parts = {p: round(sum(m for i, m in enumerate(med) if (i >= split) == (p == "draft")), 2)
                 for p in ("target", "draft")}
        print(json.dumps({"k": k, "kernels": n, "step_us": round(sum(med), 2), **parts,
                          "increments": [[nm[:40], round(m, 2)] for nm, m in zip(names, med)]}))
        eng.abort(rid)
        eng.run()


if __name__ == "__main__":
    main()
