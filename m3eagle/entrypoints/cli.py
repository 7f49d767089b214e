"""Command line: `m3eagle generate`, `m3eagle bench`, and the training / eval stages."""

from __future__ import annotations

import argparse
import json
import sys
import time


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--draft", default=None, help="Eagle3 head directory (default: the embedded head when "
                   "--model is not given)")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="K drafts per step (0 disables)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-tokens", type=int, default=512, help="token budget per step")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--overlap", choices=["auto", "on", "off"], default="auto")


def _make_llm(a: argparse.Namespace):
    from m3eagle import LLM

    overlap = None if a.overlap == "auto" else a.overlap == "on"
    return LLM(model=a.model, draft=a.draft, num_draft_tokens=a.num_draft_tokens, device=a.device,
               dtype=a.dtype, max_model_len=a.max_model_len, max_num_tokens=a.max_num_tokens,
               page_size=a.page_size, overlap=overlap)


def cmd_generate(a: argparse.Namespace) -> int:
    from m3eagle import SamplingParams

    llm = _make_llm(a)
    sp = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens,
                        seed=a.seed, stop=a.stop or [], ignore_eos=a.ignore_eos)
    t0 = time.perf_counter()
    outs = llm.generate(list(a.prompts), sp, use_tqdm=len(a.prompts) > 4 and not a.json)
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    stats = llm.stats()
    if a.json:
        for o in outs:
            print(json.dumps({"prompt": o.prompt, "text": o.text, "token_ids": o.token_ids,
                              "finish_reason": o.finish_reason}))
        print(json.dumps({"tokens": n, "seconds": round(dt, 4), "tokens_per_s": round(n / dt, 2), **stats}))
        return 0
    for o in outs:
        print(f"{o.prompt}{o.text}")
        print("-" * 40)
    print(f"{n} tokens in {dt:.2f}s: {n / dt:.1f} tokens/s", file=sys.stderr)
    if llm.config.num_draft_tokens:
        print(f"speculation K={llm.config.num_draft_tokens}: acceptance rate {stats['acceptance_rate']:.3f}, "
              f"mean acceptance length {stats['mean_acceptance_length']:.3f}, per position "
              f"{[round(x, 3) for x in stats['per_position_rates']]}", file=sys.stderr)
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from m3eagle.bench import run_bench

    print(json.dumps(run_bench(a)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="m3eagle", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("prompts", nargs="+")
    _engine_args(g)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON line per output, then a summary line")
    g.set_defaults(func=cmd_generate)
    b = sub.add_parser("bench", help="tokens/s with and without speculation on the same prompts")
    _engine_args(b)
    b.add_argument("--batch-sizes", default="1,8")
    b.add_argument("--prompt-len", type=int, default=64)
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument("--num-batches", type=int, default=2, help="batches timed per configuration")
    b.add_argument("--overlap-compare", action="store_true", help="also time overlap on vs off")
    b.set_defaults(func=cmd_bench)
    try:
        from m3eagle.training.cli import add_training_subcommands

        add_training_subcommands(sub)
    except ImportError:  # training extras are optional
        pass
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.func(a) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"m3eagle: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
