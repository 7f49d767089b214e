"""GPU checks run on the H200 through the device tool (not part of CI):

1. bf16 logit parity against transformers' MiniMaxM3VLForCausalLM on the GPU (reference and triton
   attention backends), on a tiny random config with sparse layers and a context where sparsity is on;
2. the steady-state engine step under torch.cuda.set_sync_debug_mode("error"), overlap + speculation;
3. throughput with overlap on vs off at batch 1 and 32, spec and plain, in one run.

Usage: python scripts/gpu_check.py [--out DIR]. Prints a table, ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parity(tmp: Path) -> dict:
    from hf_utils import random_hf_model, tiny_hf_config

    from m3eagle.kernels.ops import make_ops
    from m3eagle.loader.checkpoint import load_target

    res = {}
    for seed in (0, 1):
        cfg = tiny_hf_config(seed=seed, layers=4, block=16, topk=4)
        hf = random_hf_model(cfg, seed)
        d = tmp / f"parity{seed}"
        hf.save_pretrained(d)
        hf = hf.to("cuda", torch.bfloat16)
        ids = torch.randint(0, cfg.vocab_size, (2, 320), device="cuda")
        with torch.no_grad():
            ref = hf(ids).logits.float()
            ref32 = hf.float()(ids).logits.float()
        for name in ("reference", "triton"):
            try:
                ops = make_ops(name, name, "cuda")
            except Exception as e:  # noqa: BLE001
                res[f"seed{seed}_{name}"] = f"unavailable: {e}"
                continue
            m = load_target(d, torch.bfloat16, "cuda")
            from m3eagle.kernels.attention.metadata import build_metadata

            n = ids.shape[1]
            ps = 16
            pages = n // ps + 2
            caches = m.new_caches((2 * pages + 1) * ps, torch.bfloat16, torch.device("cuda"))
            table = torch.stack([torch.arange(1, pages + 1), torch.arange(pages + 1, 2 * pages + 1)])
            meta = build_metadata([n, n], torch.tensor([n, n]), table, ps, torch.device("cuda"), n)
            meta.ops = ops
            with torch.no_grad():
                out = m.compute_logits(m(ids.reshape(-1), meta.positions, meta, caches)).view(2, n, -1)
            rel = ((out - ref).norm() / ref.norm()).item()
            rel32 = ((out - ref32).norm() / ref32.norm()).item()
            agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
            res[f"seed{seed}_{name}"] = {"rel_err_vs_hf_bf16": rel, "rel_err_vs_hf_fp32": rel32,
                                         "argmax_agreement": agree}
    return res


def engine_runs(tmp: Path, model: str | None, draft: str | None, attn: str = "auto") -> dict:
    from spec_utils import random_head

    from m3eagle import LLM, SamplingParams

    if model is None:
        from hf_utils import random_hf_model, tiny_hf_config

        cfg = tiny_hf_config(seed=3, layers=6, block=16, topk=4)
        hf = random_hf_model(cfg, 3)
        model = str(tmp / "engine_target")
        hf.save_pretrained(model)
        draft = str(random_head(Path(model), tmp / "engine_draft"))
    out: dict = {}
    # (2) sync-free steady state
    llm = LLM(model, draft=draft, num_draft_tokens=3, device="cuda", overlap=True, max_model_len=1024,
              attention_backend=attn)
    g = torch.Generator().manual_seed(0)
    v = llm.target.cfg.vocab_size
    prompts = [torch.randint(3, v, (int(n),), generator=g).tolist() for n in torch.randint(8, 200, (32,), generator=g)]
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    llm.generate(prompts[:4], sp, use_tqdm=False)  # warm-up
    eng = llm.engine
    for p in prompts[:8]:
        eng.add_request(p, SamplingParams(temperature=0.7, top_p=0.9, max_tokens=48, ignore_eos=True, seed=1))
    while eng.scheduler.waiting:  # admit + prefill outside the check
        eng.step()
    eng.sync_debug = True
    steps = 0
    try:
        for _ in range(20):
            if not eng.has_work():
                break
            eng.step()
            steps += 1
        out["sync_debug_error_steps_ok"] = steps
    except RuntimeError as e:
        out["sync_debug_error"] = str(e)[:500]
    eng.sync_debug = False
    eng.run()
    eng.check_integrity()
    # (3) throughput: overlap on/off, spec on/off, batch 1 and 32
    rows = []
    for k in (0, 3):
        for ov in (False, True):
            llm = LLM(model, draft=draft if k else None, num_draft_tokens=k, device="cuda", overlap=ov,
                      max_model_len=1024, max_num_tokens=2048, attention_backend=attn)
            for bs in (1, 32):
                llm.generate(prompts[:bs], sp, use_tqdm=False)
                llm.reset_stats()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                outs = llm.generate(prompts[:bs], sp, use_tqdm=False)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                rows.append({"K": k, "overlap": ov, "batch": bs, "tok_s": round(n / dt, 1),
                             "mal": round(llm.stats()["mean_acceptance_length"], 3)})
                print(rows[-1], flush=True)
    out["throughput"] = rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--attention-backend", default="auto")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if not a.skip_parity:
        res["parity_bf16"] = parity(tmp)
        print(json.dumps(res["parity_bf16"], indent=1), flush=True)
    res["attention_backend"] = a.attention_backend
    res.update(engine_runs(tmp, a.model, a.draft, a.attention_backend))
    line = json.dumps(res)
    if a.out:
        Path(a.out).write_text(line)
    print(line)


if __name__ == "__main__":
    main()
