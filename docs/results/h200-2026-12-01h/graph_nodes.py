"""Why does replaying the engine's batch-32 (and K=3) graphs cost 50-120 us of host time in cudaGraphLaunch
when a straight-line graph of 150 plain kernels launches in ~6 us (graph_launch.py)? For the embedded
pair's graphs (K = 0 and 3, buckets 1 and 32): the host time of one replay (device drained first), and the
graph's nodes by type and its shape (edges; nodes with more than one predecessor or successor), from
CUDAGraph.debug_dump (every engine graph kept: keep_graph=True)."""

import collections
import json
import os
import statistics
import sys
import time

import torch

_Graph = torch.cuda.CUDAGraph


class KeptGraph(_Graph):
    """Every engine graph keeps its cudaGraph_t after instantiation, for the node census below."""

    def __new__(cls, *a, **kw):
        return super().__new__(cls, keep_graph=True)


torch.cuda.CUDAGraph = KeptGraph
TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "child_graph", 5: "empty", 6: "wait_event",
         7: "event_record", 8: "sem_signal", 9: "sem_wait", 10: "mem_alloc", 11: "mem_free", 12: "batch_mem_op",
         13: "conditional"}


def cudart():
    import ctypes
    import glob

    for pat in ("/opt/torch/.venv/lib/python3*/site-packages/nvidia/cuda_runtime/lib/libcudart.so*",
                os.path.dirname(torch.__file__) + "/lib/libcudart*.so*", "/usr/local/cuda/lib64/libcudart.so*"):
        for f in sorted(glob.glob(pat)):
            try:
                return ctypes.CDLL(f)
            except OSError:
                continue
    return ctypes.CDLL("libcudart.so")


def census(graph) -> dict:
    """Node types and edge structure of a kept CUDA graph (cudaGraphGetNodes / NodeGetType / GetEdges)."""
    import ctypes

    lib = cudart()
    g = ctypes.c_void_p(graph.raw_cuda_graph())
    n = ctypes.c_size_t(0)
    assert lib.cudaGraphGetNodes(g, None, ctypes.byref(n)) == 0
    nodes = (ctypes.c_void_p * n.value)()
    assert lib.cudaGraphGetNodes(g, nodes, ctypes.byref(n)) == 0
    kinds = collections.Counter()
    for node in nodes:
        t = ctypes.c_int(-1)
        lib.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t))
        kinds[TYPES.get(t.value, str(t.value))] += 1
    ne = ctypes.c_size_t(0)
    assert lib.cudaGraphGetEdges(g, None, None, ctypes.byref(ne)) == 0
    frm, to = (ctypes.c_void_p * ne.value)(), (ctypes.c_void_p * ne.value)()
    assert lib.cudaGraphGetEdges(g, frm, to, ctypes.byref(ne)) == 0
    indeg, outdeg = collections.Counter(to), collections.Counter(frm)
    return {"nodes": n.value, "edges": ne.value, "kinds": dict(kinds),
            "multi_in": sum(1 for v in indeg.values() if v > 1), "multi_out": sum(1 for v in outdeg.values() if v > 1),
            "roots": n.value - len(indeg)}


from m3eagle import LLM, SamplingParams  # noqa: E402
from m3eagle.engine.input_builder import build_step_input  # noqa: E402
from m3eagle.engine.scheduler import ScheduledBatch  # noqa: E402


def main() -> None:
    out = os.environ.get("OUT", "/tmp")
    res = []
    for k in (0, 3):
        llm = LLM(device="cuda", num_draft_tokens=k, max_num_seqs=32, max_model_len=4096)
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        llm.generate([[5 + i, 6, 7] * 10 for i in range(32)], sp)
        llm.generate([[5, 6, 7] * 10], sp)
        gr = llm.engine.graphs
        for (bucket, mode), (graph, _) in list(gr.graphs.items()):
            if bucket not in (1, 32) or mode != (False, False, False):
                continue
            try:
                info = census(graph)
            except Exception as exc:  # noqa: BLE001
                info = {"census_error": repr(exc)}
            # the step buffers as at capture: padding rows only (trash page, dump slot), so a standalone
            # replay touches no stale row of the last real step
            empty = ScheduledBatch([], [])
            build_step_input(empty, gr.page_size, gr.table_width, gr.runner.device, gr.bufs, max_kv=gr.max_kv,
                             dump_slot=gr.runner.dump_slot, ops=gr.ops, mode=mode, **gr._padding(bucket, empty))
            host = []
            for _ in range(100):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                graph.replay()
                host.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            r = {"k": k, "bucket": bucket, "launch_us": statistics.median(host) * 1e6, **info}
            res.append(r)
            print(json.dumps(r), flush=True)
        del llm
        torch.cuda.empty_cache()
    json.dump(res, open(f"{out}/graph_nodes.json", "w"))


if __name__ == "__main__":
    sys.exit(main())
