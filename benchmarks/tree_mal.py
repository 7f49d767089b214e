"""Mean acceptance length (MAL) of draft trees vs chains on the embedded pair's held-out code prompts (greedy).

    python benchmarks/tree_mal.py --prompts 32 --max-tokens 64 --chains 3,6 --trees 3,4,16 6,4,32

The prompts are `m3eagle eval`'s (stdlib code, seed 1234); every configuration's output is checked against plain
greedy decoding (lossless). MAL = 1 + accepted drafts per verify step (LLM.stats()); a tree's verify step
is one target pass over its N nodes, a chain's over its K drafts. Prints one JSON document (and writes it to
--json FILE).
"""

from __future__ import annotations

import argparse
import json
import time

from m3eagle.engine.runtime import Runtime
from m3eagle.loader.assets import default_model_paths
from m3eagle.sampling.params import SamplingParams
from m3eagle.training.evaluate import stdlib_code_prompts
from m3eagle.training.tokenizer import load_tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--chains", default="3,6", help="comma-separated K")
    p.add_argument("--trees", nargs="*", default=["3,4,16", "6,4,32"], help="D,K,N each")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=None, metavar="FILE", help="also write the JSON document here")
    a = p.parse_args()
    model, draft = default_model_paths()
    prompts = [x.ids for x in stdlib_code_prompts(load_tokenizer(model), a.prompts, a.seed)]
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    kw = dict(model=str(model), device="cpu", max_model_len=1024, max_num_seqs=32)
    t0 = time.perf_counter()
    ref = [o.outputs[0].token_ids for o in Runtime(num_draft_tokens=0, **kw).generate(prompts, sp)]
    rows = []
    configs = [("chain", int(k)) for k in a.chains.split(",") if k] + [("tree", t) for t in a.trees]
    for kind, val in configs:
        t = time.perf_counter()
        opt = {"num_draft_tokens": val} if kind == "chain" else {"draft_tree": val}
        llm = Runtime(draft=str(draft), **opt, **kw)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        s = llm.stats()
        rows.append({"mode": kind, "config": str(val), "mean_acceptance_length": round(s["mean_acceptance_length"], 3),
                     "verify_steps": s["num_verify_steps"], "verified_drafts_per_step": llm.engine.k,
                     "lossless": sum(x == y for x, y in zip(outs, ref)) / len(ref),
                     "wall_s": round(time.perf_counter() - t, 1)})
        print(json.dumps(rows[-1]), flush=True)
    doc = {"command": "python benchmarks/tree_mal.py --prompts {} --max-tokens {} --chains {} --trees {}".format(
               a.prompts, a.max_tokens, a.chains, " ".join(a.trees)),
           "device": "cpu (fp32)", "prompts": len(prompts), "max_tokens": a.max_tokens, "seed": a.seed,
           "results": rows, "total_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(doc, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
