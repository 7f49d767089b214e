"""GPU check: the engine's tokens with programmatic dependent launch everywhere (M3EAGLE_PDL=1) and in the
default small-bucket graphs (auto) equal those with it off (0), bit for bit (PDL only overlaps launches:
every kernel waits before touching memory). One JSON line; exit 1 on a mismatch.

    python scripts/pdl_check.py [--geometry embedded,m3-mini] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m3eagle import LLM, SamplingParams  # noqa: E402
from m3eagle.bench.geometries import resolve  # noqa: E402

TEXTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):",
         "for i in range(10):", "# parse a csv file\n", "def add(a, b):\n    return"]


def run(geometry: str, k: int, pdl: str, device: str) -> list[list[int]]:
    os.environ["M3EAGLE_PDL"] = pdl
    g = resolve(geometry)
    llm = LLM(g.model, g.draft if k else None, num_draft_tokens=k, device=device, load_format=g.load_format,
              dtype="bfloat16" if device == "cuda" else "float32", max_model_len=512, max_num_seqs=8)
    sps = [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=11 + i, max_tokens=24, ignore_eos=True)
           for i in range(len(TEXTS))]
    # the embedded model's tokenizer; m3-mini's random weights have none (ids stand in)
    prompts = [llm.encode(t) for t in TEXTS] if llm.tokenizer is not None else [
        [(7 * i + j) % 1000 + 5 for j in range(20 + i)] for i in range(len(TEXTS))]
    outs = llm.generate(prompts, sps, use_tqdm=False)
    toks = [o.outputs[0].token_ids for o in outs]
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    return toks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", default="embedded,m3-mini")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (PDL is off there)")
    a = ap.parse_args()
    res, ok = {}, True
    for geo in a.geometry.split(","):
        for k in ((0, 3) if geo == "embedded" else (0,)):
            off = run(geo, k, "0", a.device)
            for mode in ("1", "auto"):
                same = run(geo, k, mode, a.device) == off
                res[f"{geo} K={k} PDL={mode}"] = same
                ok &= same
                print(f"{geo} K={k}: tokens with M3EAGLE_PDL={mode} {'==' if same else '!='} 0", file=sys.stderr,
                      flush=True)
    print(json.dumps({"pdl_tokens_equal": res, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
