"""Training CLI: `corpus`, `tokenizer`, `train-target`, `train-draft`, `average-heads`, `eval`, `train-all`.

`add_training_subcommands(subparsers)` registers them on an argparse subparsers object (the `m3eagle`
entry point does this); `python -m m3eagle.training CMD ...` runs them standalone. Every stage writes an
output directory it resumes from, and every seed is fixed by a flag with a default.

    python -m m3eagle.training corpus    --out runs/data/corpus
    python -m m3eagle.training tokenizer --corpus runs/data/corpus --out runs/data/tok
    python -m m3eagle.training train-target --data runs/data/tok --out runs/target --time-budget 240
    python -m m3eagle.training train-draft  --data runs/data/tok --target runs/target/final \\
                                            --out runs/draft --time-budget 300
    python -m m3eagle.training average-heads runs/draft/final runs/draft2/final --out runs/soup
    python -m m3eagle.training eval --model runs/target/final --draft runs/draft/final
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import fields, replace
from pathlib import Path

import torch

from m3eagle.loader.assets import ASSETS


def _add_budget(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, default=None, help="number of optimizer steps")
    g.add_argument("--time-budget", type=float, default=None, dest="time_budget_s",
                   help="seconds of training; the step count is sized by timing the first steps")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=None, help="sequences per optimizer step (default: the preset's)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per training sequence (default: the preset's)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
    p.add_argument("--seed", type=int, default=None, help="RNG seed for init and data order (default: the preset's)")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    p.add_argument("--amp", choices=["auto", "bf16", "none"], default=None,
                   help="auto: bf16 autocast on CUDA, fp32 on CPU")
    p.add_argument("--log-every", type=int, default=None, help="optimizer steps between log lines")
    p.add_argument("--eval-every", type=int, default=None, help="optimizer steps between held-out evaluations")
    p.add_argument("--save-every", type=int, default=None, help="optimizer steps between checkpoints")


def _override(cfg, args: argparse.Namespace):
    """Replace dataclass fields by the flags the user set (None means 'keep the default')."""
    names = {f.name for f in fields(cfg)}
    return replace(cfg, **{k: v for k, v in vars(args).items() if k in names and v is not None})


def add_training_subcommands(subparsers) -> None:
    p = subparsers.add_parser("corpus", help="build the training corpus (site-packages code + arithmetic)")
    p.add_argument("--out", default="runs/data/corpus", help="output directory for the corpus shards")
    p.add_argument("--max-code-mb", type=float, default=None, help="cap on code bytes (MB)")
    p.add_argument("--arith-problems", type=int, default=None,
                   help="arithmetic problems to add to the corpus (default: the config's)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: the config's)")
    p.set_defaults(func=cmd_corpus)

    p = subparsers.add_parser("tokenizer", help="train the byte-level BPE and tokenize the corpus")
    p.add_argument("--corpus", default="runs/data/corpus", help="the corpus stage's output directory")
    p.add_argument("--out", default="runs/data/tok", help="output directory for the tokenizer and token shards")
    p.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary size (default: the config's)")
    p.add_argument("--seed", type=int, default=None, help="seed for tokenizer training (default: the config's)")
    p.set_defaults(func=cmd_tokenizer)

    p = subparsers.add_parser("train-target", help="pretrain the tiny MiniMax-M3 target")
    p.add_argument("--data", default="runs/data/tok", help="the tokenizer stage's output directory")
    p.add_argument("--out", default="runs/target", help="output directory for the target's checkpoints")
    p.add_argument("--preset", choices=["default", "tiny"], default=None, help="model size preset (default: default)")
    _add_budget(p)
    _add_common(p)
    p.set_defaults(func=cmd_train_target)

    p = subparsers.add_parser("train-draft", help="train the Eagle3 head against the frozen target")
    p.add_argument("--data", default="runs/data/tok", help="the tokenizer stage's output directory")
    p.add_argument("--target", default="runs/target/final", help="the trained target checkpoint the head drafts for")
    p.add_argument("--out", default="runs/draft", help="output directory for the head's checkpoints")
    p.add_argument("--ttt-steps", type=int, default=None, help="training-time-test unroll steps (default: the config's)")
    p.add_argument("--step-decay", type=float, default=None,
                   help="loss weight of TTT step s is STEP_DECAY ** s (default: the config's)")
    p.add_argument("--draft-vocab-size", type=int, default=None, help="draft vocabulary size (default: the config's)")
    p.add_argument("--intermediate-size", type=int, default=None, help="the head's MLP width (default: the config's)")
    p.add_argument("--init-from", default=None, help="continue from this Eagle3 checkpoint directory")
    p.add_argument("--self-distill-rows", type=int, default=None,
                   help="rows of target-generated greedy text to mix into every step (0: off)")
    p.add_argument("--self-distill-batch", type=int, default=None,
                   help="self-distilled rows per step, beside --batch-size corpus rows (default: the config's)")
    p.add_argument("--simulate", type=int, default=32, metavar="N",
                   help="after training, estimate greedy acceptance on N stdlib prompts without the engine "
                        "(0: skip)")
    _add_budget(p)
    _add_common(p)
    p.set_defaults(func=cmd_train_draft)

    p = subparsers.add_parser("average-heads", help="average the weights of Eagle3 heads of one config (a soup)")
    p.add_argument("heads", nargs="+", help="two or more head directories (config.json + model.safetensors)")
    p.add_argument("--out", required=True, help="output head directory")
    p.set_defaults(func=cmd_average_heads)

    p = subparsers.add_parser("eval", help="acceptance, losslessness, arithmetic accuracy, perplexity (JSON)")
    _add_eval_args(p)
    p.set_defaults(func=cmd_eval)

    p = subparsers.add_parser("train-all", help="corpus -> tokenizer -> target -> draft -> eval")
    p.add_argument("--out", default="runs/default", help="output root of every stage")
    p.add_argument("--preset", choices=["default", "tiny"], default="default", help="model size preset")
    p.add_argument("--target-steps", type=int, default=None,
                   help="target optimizer steps (default: train for --target-time)")
    p.add_argument("--target-time", type=float, default=240.0, help="seconds (ignored with --target-steps)")
    p.add_argument("--draft-steps", type=int, default=None, help="draft optimizer steps (default: train for --draft-time)")
    p.add_argument("--draft-time", type=float, default=300.0, help="seconds (ignored with --draft-steps)")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    p.add_argument("--install", action="store_true",
                   help=f"copy the trained model and head into {ASSETS} (the embedded default)")
    p.add_argument("--skip-eval", action="store_true", help="skip the final evaluation")
    p.set_defaults(func=cmd_train_all)


def _add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target directory (default: the embedded model)")
    p.add_argument("--draft", default=None, help="Eagle3 head directory (default: the embedded head)")
    p.add_argument("--code-prompts", type=int, default=None,
                   help="code prompts for acceptance and losslessness (default: the config's)")
    p.add_argument("--code-max-tokens", type=int, default=None,
                   help="tokens generated per code prompt (default: the config's)")
    p.add_argument("--arith-problems", type=int, default=None, help="held-out arithmetic problems (default: the config's)")
    p.add_argument("--arith-max-tokens", type=int, default=None,
                   help="tokens generated per arithmetic problem (default: the config's)")
    p.add_argument("--ppl-tokens", type=int, default=None, help="stdlib tokens for perplexity (default: the config's)")
    p.add_argument("--ks", default=None, help="comma-separated draft lengths, e.g. 1,2,3,4,5")
    p.add_argument("--seed", type=int, default=None, help="prompt sampling seed (default: the config's)")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16")
    p.add_argument("--offline", action="store_true",
                   help="engine-free acceptance estimate instead of the engine run (see simulate_acceptance)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    p.add_argument("--quick", action="store_true",
                   help="a smoke-sized run (6 code prompts x 32 tokens, 6 problems, 2k perplexity tokens, K=1,3; "
                        "under 2 minutes on 2 CPU cores); other flags still override it")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="also draw acceptance by draft position for each K (needs matplotlib: pip install "
                        "'m3eagle[plot]')")


# ------------------------------------------------------------------------------------------------
# Commands
# ------------------------------------------------------------------------------------------------


def cmd_corpus(args: argparse.Namespace) -> None:
    from m3eagle.training.corpus import CorpusConfig, build

    cfg = CorpusConfig()
    if args.max_code_mb is not None:
        cfg = replace(cfg, max_code_bytes=int(args.max_code_mb * 1e6))
    cfg = _override(cfg, args)
    print(json.dumps(build(args.out, cfg), indent=2))


def cmd_tokenizer(args: argparse.Namespace) -> None:
    from m3eagle.training.tokenizer import TokenizerConfig, build

    print(json.dumps(build(args.corpus, args.out, _override(TokenizerConfig(), args)), indent=2))


# Commands return None: the `m3eagle` entry point turns a command's return value into the exit status.


def cmd_train_target(args: argparse.Namespace) -> None:
    from m3eagle.training.target import TargetTrainConfig, train_target

    cfg = _override(TargetTrainConfig(), args)
    final = train_target(args.data, args.out, cfg)
    print(f"train-target: wrote {final}")


def cmd_train_draft(args: argparse.Namespace) -> None:
    from m3eagle.training.draft import DraftTrainConfig, train_draft

    cfg = _override(DraftTrainConfig(), args)
    final = train_draft(args.data, args.target, args.out, cfg)
    print(f"train-draft: wrote {final}")
    if args.simulate:
        sim = offline_acceptance(args.target, final, args.simulate, cfg.device)
        (Path(args.out) / "simulated_acceptance.json").write_text(json.dumps(sim, indent=2))
        print(json.dumps(sim))


def offline_acceptance(target_dir, draft_dir, n_prompts: int, device: str | None,
                       ks: tuple[int, ...] = (1, 2, 3, 4, 5), gen_tokens: int = 64, seed: int = 1234) -> dict:
    """Engine-free greedy acceptance of a trained pair on held-out stdlib prompts."""
    import torch

    from m3eagle.loader.checkpoint import load_target
    from m3eagle.loader.eagle3 import load_eagle3, share_target_weights
    from m3eagle.training.common import pick_device
    from m3eagle.training.evaluate import simulate_acceptance, stdlib_code_prompts
    from m3eagle.training.tokenizer import load_tokenizer

    dev = pick_device(device)
    target = load_target(target_dir, torch.float32, dev)
    head = share_target_weights(load_eagle3(draft_dir, target.cfg, torch.float32, dev), target)
    prompts = stdlib_code_prompts(load_tokenizer(target_dir), n_prompts, seed, max_prompt_tokens=192,
                                  min_prompt_tokens=128)
    return simulate_acceptance(target, head, [p.ids for p in prompts], gen_tokens, ks, dev, prompt_len=128)


def average_heads(heads: list[str | Path], out: str | Path) -> Path:
    """The element-wise mean (in fp32, stored in each tensor's dtype) of the floating-point weights of
    heads that share one config and one draft vocabulary -- continuations of one run, say, that a
    validation set cannot tell apart. Integer tensors (d2t / t2d) must be equal; anything else that
    differs (config, tensor names or shapes) is an error naming it."""
    from safetensors.torch import load_file, save_file

    if len(heads) < 2:
        raise ValueError("average-heads needs at least two head directories")
    dirs = [Path(h) for h in heads]
    config = (dirs[0] / "config.json").read_text()
    states = []
    for d in dirs:
        if json.loads((d / "config.json").read_text()) != json.loads(config):
            raise ValueError(f"{d}/config.json differs from {dirs[0]}/config.json: only heads of one config average")
        states.append(load_file(str(d / "model.safetensors")))
    merged = {}
    for name, first in states[0].items():
        for d, st in zip(dirs[1:], states[1:]):
            if name not in st or st[name].shape != first.shape or st[name].dtype != first.dtype:
                raise ValueError(f"tensor {name!r} is missing or shaped differently in {d}")
            if not first.is_floating_point() and not torch.equal(st[name], first):
                raise ValueError(f"integer tensor {name!r} differs in {d} (another draft vocabulary?)")
        if first.is_floating_point():
            merged[name] = (sum(st[name].float() for st in states) / len(states)).to(first.dtype)
        else:
            merged[name] = first
    extra = set().union(*(set(st) for st in states[1:])) - set(states[0])
    if extra:
        raise ValueError(f"tensors {sorted(extra)} are not in {dirs[0]}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(config)
    save_file(merged, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def cmd_average_heads(args: argparse.Namespace) -> None:
    out = average_heads(args.heads, args.out)
    print(f"wrote the mean of {len(args.heads)} heads to {out}")


def cmd_eval(args: argparse.Namespace) -> None:
    from m3eagle.training.evaluate import QUICK, EvalConfig, dumps, plot_acceptance, require_matplotlib, run_eval

    if args.plot:
        require_matplotlib()  # fail before the long run, naming the extra
    cfg = QUICK if args.quick else EvalConfig()
    if args.ks:
        cfg = replace(cfg, ks=tuple(int(k) for k in args.ks.split(",")))
    cfg = _override(cfg, argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "ks"}))
    if args.offline:
        from m3eagle.loader.assets import default_model_paths

        model, draft = (args.model, args.draft) if args.model else default_model_paths()
        result = offline_acceptance(model, args.draft or draft, cfg.code_prompts, cfg.device, cfg.ks,
                                    cfg.code_max_tokens, cfg.seed)
    else:
        result = run_eval(args.model, args.draft, cfg)
    text = dumps(result)
    if args.output:
        Path(args.output).write_text(text)
    if args.plot:
        plot_acceptance(result, args.plot)
    print(text)


def install_assets(target_final: str | Path, draft_final: str | Path, dest: Path = ASSETS) -> None:
    """Copy a trained target (+ tokenizer) and head into the package's embedded-default directory."""
    for src, name, files in ((Path(target_final), "target", ("config.json", "model.safetensors",
                                                              "tokenizer.json", "tokenizer_config.json")),
                             (Path(draft_final), "draft", ("config.json", "model.safetensors"))):
        d = dest / name
        d.mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copyfile(src / f, d / f)  # not copy(): a read-only source must not stay read-only
            (d / f).chmod(0o644)
    total = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"installed the default model into {dest} ({total / 1e6:.1f} MB)")


def cmd_train_all(args: argparse.Namespace) -> None:
    from m3eagle.training.corpus import CorpusConfig
    from m3eagle.training.corpus import build as build_corpus
    from m3eagle.training.draft import DraftTrainConfig, train_draft
    from m3eagle.training.evaluate import EvalConfig, dumps, run_eval
    from m3eagle.training.target import TargetTrainConfig, train_target
    from m3eagle.training.tokenizer import TokenizerConfig
    from m3eagle.training.tokenizer import build as build_tok

    out = Path(args.out)
    build_corpus(out / "corpus", CorpusConfig())
    build_tok(out / "corpus", out / "tok", TokenizerConfig())
    tcfg = TargetTrainConfig(preset=args.preset, steps=args.target_steps, device=args.device,
                             time_budget_s=None if args.target_steps else args.target_time)
    target = train_target(out / "tok", out / "target", tcfg)
    dcfg = DraftTrainConfig(steps=args.draft_steps, device=args.device,
                            time_budget_s=None if args.draft_steps else args.draft_time)
    draft = train_draft(out / "tok", target, out / "draft", dcfg)
    if args.install:
        install_assets(target, draft)
    if not args.skip_eval:
        result = run_eval(target, draft, EvalConfig(device=args.device))
        (out / "eval.json").write_text(dumps(result))
        print(dumps(result))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m m3eagle.training",
                                     description="Train and evaluate m3eagle's embedded default model.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_training_subcommands(sub)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
