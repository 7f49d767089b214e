"""Host cost of cudaGraphLaunch against the number of kernel nodes: is one graph per multi-step iteration
(N sub-steps captured together) cheaper to launch than N replays of one sub-step's graph?

Graphs of n tiny kernels (in-place adds on a 32-element tensor, one stream, straight-line), n in SIZES.
For each: the median host time of `graph.replay()` (the call alone; the device drained between calls)
and the device time per replay (CUDA events around 50 back-to-back replays)."""

import json
import statistics
import time

import torch

SIZES = (50, 150, 300, 600, 1200, 2400)


def main() -> None:
    x = torch.zeros(32, device="cuda")
    rows = []
    for n in SIZES:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                x.add_(1.0)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for _ in range(n):
                x.add_(1.0)
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        host = []
        for _ in range(200):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            g.replay()
            host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(50):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        r = {"kernels": n, "launch_us": statistics.median(host) * 1e6, "launch_us_p90": sorted(host)[180] * 1e6,
             "device_us_per_replay": a.elapsed_time(b) * 1e3 / 50}
        r["launch_us_per_kernel"] = r["launch_us"] / n
        rows.append(r)
        print(f"{n:>6} kernels: launch {r['launch_us']:8.1f} us (p90 {r['launch_us_p90']:.1f}), "
              f"{r['launch_us_per_kernel']:.3f} us/kernel; device {r['device_us_per_replay']:.1f} us/replay", flush=True)
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "rows": rows}))


if __name__ == "__main__":
    main()
