"""Inside the engine's steady loop (embedded pair, batch 32, K = 0 / 3, num_scheduler_steps 1 / 4): each
replay()'s host time, and whether the device had already drained the work queued before it (an event
recorded just before the replay, queried right before it). graph_block.py found replays cost 3-9 us
outside the engine; the bench reports 50-125 us per step inside it."""

import json
import statistics
import time

import torch

from m3eagle import LLM, SamplingParams


def main() -> None:
    for k in (0, 3):
        for n in (1, 4):
            llm = LLM(device="cuda", num_draft_tokens=k, max_num_seqs=32, max_model_len=4096, num_scheduler_steps=n)
            eng = llm.engine
            gr = eng.graphs
            sp = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            reqs = [eng.add_request([5 + i, 6, 7] * 40, sp, stream_text=False) for i in range(32)]
            for _ in range(12):
                eng.step()
            rows = []
            real_run = gr._run

            def timed_run(inp, bucket, real_run=real_run, rows=rows):
                ev = torch.cuda.Event()
                ev.record()
                idle = ev.query()  # True: everything queued before this replay has finished
                t0 = time.perf_counter()
                out = real_run(inp, bucket)
                rows.append(((time.perf_counter() - t0) * 1e6, idle, bucket is not None))
                return out

            gr._run = timed_run
            t0 = time.perf_counter()
            s0 = eng.num_steps
            for _ in range(40):
                eng.step()
            torch.cuda.synchronize()
            step_ms = (time.perf_counter() - t0) * 1e3 / (eng.num_steps - s0)
            gr._run = real_run
            graphed = [r for r in rows if r[2]]
            busy = [r[0] for r in graphed if not r[1]]
            idle = [r[0] for r in graphed if r[1]]
            med = statistics.median
            print(json.dumps({"k": k, "n": n, "step_ms": step_ms, "replays": len(graphed),
                              "launch_us_median": med(r[0] for r in graphed),
                              "device_idle_at_launch": len(idle), "launch_us_when_idle": med(idle) if idle else None,
                              "launch_us_when_busy": med(busy) if busy else None,
                              "launch_us_p90": sorted(r[0] for r in graphed)[int(0.9 * len(graphed))]}), flush=True)
            for q in reqs:
                eng.abort(q.request_id)
            eng.run()
            del llm, eng, gr
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
