"""Does launching a CUDA graph that is still running block the host? (GPU only)

    python benchmarks/graph_relaunch.py [--nodes 110] [--replays 200] [--engine] [--k 0,3]

The overlap scheduler launches step N+1's graph while step N's is still on the device. At batch 1 the
bucket's graph is the same executable every step, so each launch relaunches a graph in flight. This
times, per iteration, the host time inside `replay()` and the wall time, for:

- a synthetic graph of --nodes dependent tiny kernels (about the embedded K=3 step's length), launched
  back to back and with host work between launches (a CPU spin of a fraction of the graph's time, as the
  engine's Python is), once relaunching one executable and once alternating two captures of the same work;
- with --engine, the embedded pair's batch-1 step (K from --k): the engine's steady step and the graph
  replayed back to back, each with one executable and with two alternating (a second capture of the
  bucket, same pool).

One JSON line per case on stdout; a readable line per case on stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def loop(graphs: list[torch.cuda.CUDAGraph], n: int, host_s: float) -> tuple[float, float]:
    """(wall ms per iteration, host ms inside replay() per iteration) over n iterations, cycling through
    `graphs`, with `host_s` seconds of CPU work after each launch."""
    torch.cuda.synchronize()
    launch = 0.0
    t0 = time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        graphs[i % len(graphs)].replay()
        launch += time.perf_counter() - t
        if host_s:
            spin(host_s)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3, launch / n * 1e3


def synthetic(nodes: int, replays: int, repeats: int = 5) -> None:
    x = torch.zeros(256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for _ in range(2):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(nodes):
                x.add_(1)
        graphs.append(g)
    for _ in range(3):
        loop(graphs, 20, 0.0)
    alone, _ = loop(graphs[:1], replays, 0.0)  # back to back: the graph's device time, about
    for frac in (0.0, 0.5, 0.8):
        for name, gs in (("one", graphs[:1]), ("two", graphs)):
            runs = [loop(gs, replays, frac * alone / 1e3) for _ in range(repeats)]
            wall = statistics.median(r[0] for r in runs)
            launch = statistics.median(r[1] for r in runs)
            rec = {"case": "synthetic", "nodes": nodes, "host_fraction": frac, "executables": name,
                   "graph_ms": alone, "wall_ms": wall, "launch_ms": launch}
            print(json.dumps(rec))
            print(f"synthetic {nodes} nodes, host work {frac:.1f} x graph ({alone:.3f} ms), {name} executable(s): "
                  f"{wall:.4f} ms per iteration, launch {launch:.4f} ms", file=sys.stderr)


def engine_case(k: int, steps: int, repeats: int = 3) -> None:
    from m3eagle import LLM, SamplingParams
    from m3eagle.engine.graph_runner import bucket_for

    llm = LLM(device="cuda", num_draft_tokens=k, max_num_seqs=32, max_model_len=4096)
    eng = llm.engine
    gr = eng.graphs
    sp = SamplingParams(temperature=0, max_tokens=3900, ignore_eos=True)
    rid = eng.add_request(llm.encode("def f(x):\n    return x + 1\n"), sp, stream_text=False).request_id
    for _ in range(10):
        eng.step()
    key = next(key for key in gr.graphs if key[0] == bucket_for(1, gr.buckets))
    first = gr.graphs.pop(key)  # a second capture of the same step, in the same pool
    gr._capture(*key)
    second = gr.graphs[key]
    gr.graphs[key] = first
    for _ in range(5):  # real inputs back in the buffers
        eng.step()

    def engine_ms(n: int) -> float:
        torch.cuda.synchronize()
        n0 = eng.num_steps
        t0 = time.perf_counter()
        for _ in range(n):
            eng.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / (eng.num_steps - n0) * 1e3

    real_run = gr._run
    flip = [0]

    def alternating(inp, bucket):
        if bucket is None:
            return real_run(inp, bucket)
        flip[0] ^= 1
        graph, static = first if flip[0] else second
        t = time.perf_counter()
        graph.replay()
        gr.launch_seconds += time.perf_counter() - t
        gr.num_replays += 1
        return static.fresh()

    res: dict[str, list] = {}
    for name in ("one", "two") * repeats:
        gr._run = real_run if name == "one" else alternating
        l0, r0 = gr.launch_seconds, gr.num_replays
        ms = engine_ms(steps)
        launch = (gr.launch_seconds - l0) / max(gr.num_replays - r0, 1) * 1e3
        res.setdefault(name, []).append([ms, launch])
    gr._run = real_run
    for _ in range(repeats):  # last: back-to-back replays rewrite the row's device state
        for name, gs in (("one", [first[0]]), ("two", [first[0], second[0]])):
            wall, launch = loop(gs, 2 * steps, 0.0)
            res[name].append([wall, launch])
    for name, runs in res.items():
        eng_runs, rep_runs = runs[:repeats], runs[repeats:]
        rec = {"case": "engine", "k": k, "batch": 1, "executables": name,
               "engine_step_ms": statistics.median(r[0] for r in eng_runs),
               "engine_launch_ms": statistics.median(r[1] for r in eng_runs),
               "replay_ms": statistics.median(r[0] for r in rep_runs),
               "replay_launch_ms": statistics.median(r[1] for r in rep_runs)}
        print(json.dumps(rec))
        print(f"engine K={k} b1, {name} executable(s): engine step {rec['engine_step_ms']:.4f} ms (launch "
              f"{rec['engine_launch_ms']:.4f}), back-to-back replay {rec['replay_ms']:.4f} ms (launch "
              f"{rec['replay_launch_ms']:.4f})", file=sys.stderr)
    eng.abort(rid)
    eng.run()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=110)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--k", default="0,3")
    ap.add_argument("--steps", type=int, default=100)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_relaunch.py needs a CUDA device")
    synthetic(a.nodes, a.replays)
    if a.engine:
        for k in (int(x) for x in a.k.split(",")):
            engine_case(k, a.steps)


if __name__ == "__main__":
    main()
