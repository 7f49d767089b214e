"""Diagnostic (GPU): does a prefill graph change what the draft head proposes? Per configuration, the
acceptance counts and the output tokens of 6 batch-1 requests (128-token stdlib prompts, 64 new tokens,
greedy, K=3). Tokens must agree everywhere (lossless); acceptance should too, up to bf16 rounding.

    python scripts/diag_prefill_acceptance.py
"""
import json
import sys

import torch

from m3eagle import LLM, SamplingParams
from m3eagle.bench.offline import make_prompts

CONFIGS = {
    "plain_graphs": dict(),
    "prefill_eager": dict(prefill_graphs=True, enforce_eager=True),
    "prefill_graphs": dict(prefill_graphs=True),
    "prefill_graphs_fused_ref": dict(prefill_graphs=True, fused_backend="reference"),
    "prefill_graphs_attn_ref": dict(prefill_graphs=True, attention_backend="reference"),
    "eager_unpadded": dict(enforce_eager=True),
}
res = {}
for name, kw in CONFIGS.items():
    try:
        dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
        llm = LLM(device=dev, dtype="bfloat16" if dev == "cuda" else "float32", **kw)
        prompts, _ = make_prompts(llm.tokenizer,
                                  llm.target.cfg.vocab_size, 6, 128, 0)
        sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        acc, toks = [], []
        for p in prompts:
            o = llm.generate([p], sp, use_tqdm=False)[0]
            acc.append(o.metrics.num_accepted)
            toks.append(o.outputs[0].token_ids)
        res[name] = {"accepted": acc, "tokens": toks}
        print(name, acc, file=sys.stderr, flush=True)
        del llm
        torch.cuda.empty_cache()
    except Exception as exc:  # keep going: the point is the comparison
        print(name, "failed:", repr(exc), file=sys.stderr, flush=True)
base = res.get("plain_graphs", {}).get("tokens")
for name, r in res.items():
    print(name, "accepted", r["accepted"], "tokens equal plain_graphs:", r["tokens"] == base, file=sys.stderr)
print(json.dumps({k: v["accepted"] for k, v in res.items()}))
