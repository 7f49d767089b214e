"""Does replaying an engine graph block the host while the device still runs the previous replay?

graph_nodes.py found the embedded pair's graphs launch in 3-9 us with the device drained, while the bench
reports 50-125 us of host time inside replay() per step at batch 32. For each (K, bucket 1 / 32), on
padding rows: the host time of replay() with the device drained; of the second of two back-to-back
replays; of each of 8 back-to-back replays of one graph; and of 8 replays alternating between two graph
execs of the same step (the bucket captured twice); and the device time of one replay."""

import json
import statistics
import time

import torch

from m3eagle import LLM, SamplingParams
from m3eagle.engine.input_builder import build_step_input
from m3eagle.engine.scheduler import ScheduledBatch


def host_us(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def main() -> None:
    for k in (0, 3):
        llm = LLM(device="cuda", num_draft_tokens=k, max_num_seqs=32, max_model_len=4096)
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        llm.generate([[5 + i, 6, 7] * 10 for i in range(32)], sp)
        gr = llm.engine.graphs
        mode = (False, False, False)
        for bucket in (32, 1):
            empty = ScheduledBatch([], [])
            build_step_input(empty, gr.page_size, gr.table_width, gr.runner.device, gr.bufs, max_kv=gr.max_kv,
                             dump_slot=gr.runner.dump_slot, ops=gr.ops, mode=mode, **gr._padding(bucket, empty))
            g1 = gr.graphs[(bucket, mode)][0]
            g1.replay()
            torch.cuda.synchronize()
            drained = []
            for _ in range(30):
                torch.cuda.synchronize()
                drained.append(host_us(g1.replay))
            second = []
            for _ in range(30):
                torch.cuda.synchronize()
                g1.replay()
                second.append(host_us(g1.replay))
            chains = []
            for _ in range(10):
                torch.cuda.synchronize()
                chains.append([host_us(g1.replay) for _ in range(8)])
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(20):
                g1.replay()
            b.record()
            torch.cuda.synchronize()
            dev_us = a.elapsed_time(b) * 1e3 / 20
            # a second exec of the same step
            first = gr.graphs.pop((bucket, mode))
            gr._capture(bucket, mode)
            g2 = gr.graphs[(bucket, mode)][0]
            build_step_input(empty, gr.page_size, gr.table_width, gr.runner.device, gr.bufs, max_kv=gr.max_kv,
                             dump_slot=gr.runner.dump_slot, ops=gr.ops, mode=mode, **gr._padding(bucket, empty))
            alt = []
            for _ in range(10):
                torch.cuda.synchronize()
                alt.append([host_us((g1 if i % 2 == 0 else g2).replay) for i in range(8)])
            torch.cuda.synchronize()
            gr.graphs[(bucket, mode)] = first
            med = statistics.median
            r = {"k": k, "bucket": bucket, "device_us_per_replay": dev_us, "drained_us": med(drained),
                 "second_us": med(second), "chain_us": [round(med(c[i] for c in chains), 1) for i in range(8)],
                 "alternating_us": [round(med(c[i] for c in alt), 1) for i in range(8)]}
            print(json.dumps(r), flush=True)
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
