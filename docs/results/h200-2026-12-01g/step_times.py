"""Wall time of each engine.step() for the embedded pair, K=3, batch 1, num_scheduler_steps 1 and 8 (the
replay_wall anomaly of call3: 0.754 ms per device step at N=8): 60 steady engine steps, sorted."""
import time

import torch

from m3eagle import LLM, SamplingParams

for n in (1, 8):
    llm = LLM(device="cuda", num_draft_tokens=3, max_num_seqs=32, max_model_len=4096, num_scheduler_steps=n)
    eng = llm.engine
    r = eng.add_request(llm.encode("def f(x):\n    return x + 1\n"), SamplingParams(temperature=0, max_tokens=3000,
                        ignore_eos=True), stream_text=False)
    for _ in range(10):
        eng.step()
    torch.cuda.synchronize()
    times, n0 = [], eng.num_steps
    t00 = time.perf_counter()
    for _ in range(60):
        t0 = time.perf_counter()
        eng.step()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t00) * 1e3
    d = eng.num_steps - n0
    print(f"N={n}: {d} device steps in {wall:.1f} ms = {wall / d:.3f} ms each; context {len(r.output_token_ids)}; "
          f"engine.step ms sorted: {[round(t, 2) for t in sorted(times)]}")
    eng.abort(r.request_id)
    eng.run()
