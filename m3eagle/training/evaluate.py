"""Evaluation harness (`m3eagle eval`): acceptance, losslessness, arithmetic accuracy, perplexity.

Held-out data, built deterministically from seeds:

- code prompts: Python standard-library functions (the corpus never holds the stdlib), each cut at a
  random line of its body; the prompt is the file up to that line (without the line break that ends
  it), left-truncated to `max_prompt_tokens`. Packages that are tests, GUIs, codec tables or legacy copies are skipped
  (`EVAL_SKIP`): they are either repetitive (inflating acceptance) or not representative code;
- arithmetic: generated problems from another seed than the corpus's, minus any question the training
  set holds; scored by exact match of the integer after '####';
- perplexity: other stdlib files, in `seq_len` windows.

The engine-facing part (`run_eval`) uses the offline API: `LLM(...).generate` with greedy sampling,
once without speculation (the reference) and once per K with it; each stage is logged (the `m3eagle`
logger) with its elapsed time, and generate's tqdm bars show on a terminal. `QUICK` is a smoke-sized
configuration (`m3eagle eval --quick`: 6 code prompts x 32 tokens, 6 problems, 2k perplexity tokens,
K in {1, 3}; under 2 minutes on 2 CPU cores); `plot_acceptance` draws acceptance by draft position for
each K (matplotlib, the `plot` extra). `simulate_acceptance` is an
engine-free estimate (greedy generation by recomputation, then the TTT-unrolled head on those tokens,
walked the way the engine walks a greedy chain); training uses it to report progress.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from m3eagle.training import arithmetic
from m3eagle.training.common import autocast, greedy_continue
from m3eagle.training.corpus import CorpusConfig, stdlib_dir, stdlib_files
from m3eagle.training.draft import ttt_forward

log = logging.getLogger("m3eagle")

EVAL_SKIP = frozenset({"test", "tests", "idlelib", "lib2to3", "distutils", "turtledemo", "tkinter",
                       "ensurepip", "encodings", "pydoc_data", "__phello__", "turtle.py"})


# ------------------------------------------------------------------------------------------------
# Held-out data
# ------------------------------------------------------------------------------------------------


def eval_stdlib_files() -> list[Path]:
    root = stdlib_dir()
    out = []
    for p in stdlib_files():
        parts = p.relative_to(root).parts
        if parts[0] in EVAL_SKIP or parts[0].startswith("config-") or "tests" in parts or "test" in parts:
            continue
        out.append(p)
    return out


@dataclass(frozen=True)
class CodePrompt:
    file: str
    function: str
    cut_line: int  # 1-based line of the file the prompt stops before
    ids: list[int]


def stdlib_code_prompts(tok, n: int, seed: int = 1234, max_prompt_tokens: int = 192,
                        min_prompt_tokens: int = 48) -> list[CodePrompt]:
    """n prompts, one per stdlib file (seeded file order), each a function body cut at a random line."""
    r = random.Random(seed)
    files = eval_stdlib_files()
    r.shuffle(files)
    out: list[CodePrompt] = []
    for p in files:
        if len(out) == n:
            break
        try:
            text = p.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        funcs = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and f.end_lineno is not None and f.end_lineno - f.body[0].lineno >= 3]
        if not funcs:
            continue
        f = r.choice(sorted(funcs, key=lambda f: f.lineno))
        # Cut strictly inside the body: at least one body line is in the prompt, one is left to predict.
        cut = r.randint(f.body[0].lineno + 1, f.end_lineno)
        lines = text.splitlines(keepends=True)
        # The prompt stops at the end of the last kept line, *before* its newline: byte-level BPE merges a
        # newline with the next line's indentation, so a prompt ending in a bare newline token reads
        # like the end of a file and the model answers EOS.
        text_before = "".join(lines[:cut - 1]).rstrip("\r\n")
        ids = tok.encode(text_before, add_special_tokens=False).ids[-max_prompt_tokens:]
        if len(ids) < min_prompt_tokens:
            continue
        out.append(CodePrompt(str(p.relative_to(stdlib_dir())), f.name, cut, ids))
    return out


def stdlib_ppl_stream(tok, n_tokens: int, seed: int = 4321) -> np.ndarray:
    """About n_tokens of stdlib code (EOS after each file), seeded file order."""
    r = random.Random(seed)
    files = eval_stdlib_files()
    r.shuffle(files)
    eos = tok.token_to_id("<|endoftext|>")
    parts, total = [], 0
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        ids = tok.encode(text, add_special_tokens=False).ids + [eos]
        parts.append(np.asarray(ids, dtype=np.int64))
        total += len(ids)
        if total >= n_tokens:
            break
    return np.concatenate(parts)[:n_tokens]


# ------------------------------------------------------------------------------------------------
# Metrics that need no engine
# ------------------------------------------------------------------------------------------------


@torch.no_grad()
def perplexity(model, stream: np.ndarray, seq_len: int, device: torch.device, batch: int = 8,
               amp: str = "auto") -> dict[str, float]:
    """Mean next-token NLL over non-overlapping seq_len windows of `stream` (the target's forward_seq)."""
    n_win = (len(stream) - 1) // seq_len
    if n_win < 1:
        raise ValueError(f"perplexity needs more than seq_len={seq_len} tokens, got {len(stream)}")
    total_nll, total_tok = 0.0, 0
    for i in range(0, n_win, batch):
        rows = [stream[j * seq_len:(j + 1) * seq_len + 1] for j in range(i, min(n_win, i + batch))]
        x = torch.from_numpy(np.stack(rows)).to(device)
        with autocast(device, amp):
            hidden, _ = model.forward_seq(x[:, :-1])
            logits = model.compute_logits(hidden)
        nll = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
        total_nll += nll.item()
        total_tok += x[:, 1:].numel()
    mean = total_nll / total_tok
    return {"tokens": total_tok, "nll": mean, "perplexity": math.exp(mean)}


def accuracy(problems: list[arithmetic.Problem], texts: list[str]) -> float:
    """Exact-match accuracy of the '#### N' answers in the generated texts."""
    if not problems:
        return 0.0
    ok = sum(arithmetic.parse_answer(t) == p.answer for p, t in zip(problems, texts))
    return ok / len(problems)


def equal_fraction(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of prompts whose generated token lists are identical."""
    return sum(x == y for x, y in zip(a, b)) / max(1, len(a))


@dataclass
class AcceptanceStats:
    """Greedy chain speculation statistics, in the engine's definitions (LLM.stats())."""

    k: int
    rounds: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, a: int) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.k
        self.rounds += 1
        self.accepted += a
        for j in range(a):
            self.accepted_per_position[j] += 1

    def as_dict(self) -> dict[str, Any]:
        r = max(1, self.rounds)
        per = self.accepted_per_position or [0] * self.k
        return {"num_draft_tokens": self.k, "num_verify_steps": self.rounds,
                "acceptance_rate": self.accepted / (r * self.k),
                "mean_acceptance_length": 1 + self.accepted / r,
                "per_position_rates": [round(x / r, 4) for x in per]}


@torch.no_grad()
def simulate_acceptance(target, head, prompts: list[list[int]], gen_tokens: int, ks: tuple[int, ...],
                        device: torch.device, amp: str = "auto", prompt_len: int = 128,
                        batch: int = 32) -> dict[str, Any]:
    """Engine-free greedy acceptance: generate greedily, run the TTT-unrolled head over the result, and
    walk each sequence as the engine does (start after the prompt; a round accepting a drafts moves the
    chain a + 1 tokens). Prompts are left-truncated to prompt_len (shorter ones are dropped) so they
    batch without padding."""
    rows = [p[-prompt_len:] for p in prompts if len(p) >= prompt_len]
    if not rows:
        raise ValueError(f"no prompt has >= prompt_len={prompt_len} tokens")
    kmax = max(ks)
    stats = {k: AcceptanceStats(k) for k in ks}
    for i in range(0, len(rows), batch):
        ids = torch.tensor(rows[i:i + batch], dtype=torch.long)
        seq = greedy_continue(target, ids, gen_tokens, device, amp)  # [B, S]
        o = ttt_forward(target, head, seq, kmax, 1.0, device, amp)
        # match[s][b, i]: the step-s draft of the chain after token i+1 equals greedy token i+2+s.
        match = torch.stack([o.draft_argmax[s] == F.pad(seq[:, 2 + s:], (0, 2 + s), value=-1)
                             for s in range(kmax)], dim=-1).cpu().numpy()  # [B, S, kmax]
        s_len = seq.shape[1]
        for b in range(seq.shape[0]):
            for k in ks:
                pos = prompt_len - 1
                while pos + 1 + k <= s_len - 1:
                    a = 0
                    while a < k and match[b, pos, a]:
                        a += 1
                    stats[k].add(a)
                    pos += a + 1
    return {f"K={k}": stats[k].as_dict() for k in ks} | {"num_prompts": len(rows), "prompt_len": prompt_len,
                                                         "gen_tokens": gen_tokens}


# ------------------------------------------------------------------------------------------------
# Engine evaluation
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalConfig:
    code_prompts: int = 128
    code_max_tokens: int = 64
    arith_problems: int = 100
    arith_max_tokens: int = 128
    ppl_tokens: int = 65_536
    ppl_seq_len: int = 512
    ks: tuple[int, ...] = (1, 2, 3, 4, 5)
    spec_k_arith: int = 3
    seed: int = 1234
    device: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the LLM's default (a smaller KV pool starts faster)
    corpus_arith_problems: int = CorpusConfig.arith_problems  # to exclude training questions
    corpus_arith_seed: int = CorpusConfig.arith_seed


# `m3eagle eval --quick`: every stage runs, on a smoke-test budget (under 2 minutes on 2 CPU cores).
QUICK = EvalConfig(code_prompts=6, code_max_tokens=32, arith_problems=6, arith_max_tokens=40, ppl_tokens=2048,
                   ppl_seq_len=512, ks=(1, 3), max_model_len=512)


class _Progress:
    """Stage lines on the m3eagle logger: `[i/n] what (elapsed)`, so a long eval is never silent."""

    def __init__(self, total: int):
        self.total, self.i, self.t0 = total, 0, time.perf_counter()

    def __call__(self, what: str) -> None:
        self.i += 1
        log.info("eval [%d/%d] %s (%.0f s elapsed)", self.i, self.total, what, time.perf_counter() - self.t0)


def _llm(model: Path, draft: Path | None, k: int, cfg: EvalConfig):
    from m3eagle.engine.runtime import Runtime

    return Runtime(model=str(model), draft=str(draft) if draft is not None and k > 0 else None,
               num_draft_tokens=k, device=cfg.device, dtype=cfg.dtype, max_model_len=cfg.max_model_len)


def run_eval(model_dir: str | Path | None, draft_dir: str | Path | None, cfg: EvalConfig = EvalConfig(),
             ) -> dict[str, Any]:
    """Everything the README reports, as one dict (the CLI prints it as JSON)."""
    from m3eagle.loader.assets import default_model_paths
    from m3eagle.sampling.params import SamplingParams
    from m3eagle.training.tokenizer import load_tokenizer

    if model_dir is None:
        model_dir, default_draft = default_model_paths()
        draft_dir = draft_dir or default_draft
    model_dir = Path(model_dir)
    draft_dir = Path(draft_dir) if draft_dir is not None else None
    tok = load_tokenizer(model_dir)
    prompts = stdlib_code_prompts(tok, cfg.code_prompts, cfg.seed)
    problems = arithmetic.heldout_problems(cfg.arith_problems, cfg.seed + 1, cfg.corpus_arith_seed,
                                           cfg.corpus_arith_problems)
    arith_ids = [tok.encode(p.prompt, add_special_tokens=False).ids for p in problems]
    code_sp = SamplingParams(temperature=0.0, max_tokens=cfg.code_max_tokens)
    arith_sp = SamplingParams(temperature=0.0, max_tokens=cfg.arith_max_tokens)

    def texts(outs) -> list[str]:
        return [tok.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outs]

    ks = cfg.ks if draft_dir is not None else ()
    step = _Progress(3 + len(ks) + (cfg.spec_k_arith in ks))
    step(f"reference (no speculation): {len(prompts)} code prompts x {cfg.code_max_tokens} tokens")
    base = _llm(model_dir, None, 0, cfg)
    code_ref = [o.outputs[0].token_ids for o in base.generate([p.ids for p in prompts], code_sp)]
    step(f"reference: {len(problems)} arithmetic problems x {cfg.arith_max_tokens} tokens")
    arith_ref = base.generate(arith_ids, arith_sp)
    result: dict[str, Any] = {
        "model": str(model_dir), "draft": str(draft_dir) if draft_dir else None,
        "device": str(base.device), "dtype": str(base.dtype).replace("torch.", ""),
        "config": asdict(cfg),
    }
    step(f"perplexity over {cfg.ppl_tokens} stdlib tokens")
    ppl_stream = stdlib_ppl_stream(tok, cfg.ppl_tokens + 1)
    result["perplexity_stdlib"] = perplexity(base.target, ppl_stream, cfg.ppl_seq_len, base.device,
                                             amp="none" if base.dtype == torch.float32 else "bf16")
    del base
    code: dict[str, Any] = {"num_prompts": len(prompts), "max_tokens": cfg.code_max_tokens, "acceptance": {},
                            "lossless": {}}
    arith: dict[str, Any] = {"num_problems": len(problems), "max_tokens": cfg.arith_max_tokens,
                             "accuracy_no_spec": accuracy(problems, texts(arith_ref))}
    if draft_dir is not None:
        for k in ks:
            step(f"speculation K={k}: code prompts")
            llm = _llm(model_dir, draft_dir, k, cfg)
            outs = llm.generate([p.ids for p in prompts], code_sp)
            code["acceptance"][f"K={k}"] = _acceptance(llm.stats())
            code["lossless"][f"K={k}"] = equal_fraction([o.outputs[0].token_ids for o in outs], code_ref)
            log.info("eval K=%d: mean acceptance length %.3f, lossless %.0f%%", k,
                     code["acceptance"][f"K={k}"]["mean_acceptance_length"], 100 * code["lossless"][f"K={k}"])
            if k == cfg.spec_k_arith:
                step(f"speculation K={k}: arithmetic problems")
                llm.reset_stats()
                spec = llm.generate(arith_ids, arith_sp)
                arith["spec_k"] = k
                arith["accuracy_spec"] = accuracy(problems, texts(spec))
                arith["acceptance"] = _acceptance(llm.stats())
                arith["lossless"] = equal_fraction([o.outputs[0].token_ids for o in spec],
                                                   [o.outputs[0].token_ids for o in arith_ref])
                arith["accuracy_equal"] = arith["accuracy_spec"] == arith["accuracy_no_spec"]
    result["code"], result["arithmetic"] = code, arith
    return result


def _acceptance(stats: dict[str, Any]) -> dict[str, Any]:
    keep = ("mean_acceptance_length", "acceptance_rate", "per_position_rates", "num_verify_steps",
            "num_generated_tokens")
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in stats.items() if k in keep}


def dumps(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2)


def require_matplotlib():
    """matplotlib.pyplot on the Agg backend, or an ImportError that names the extra to install."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plotting needs matplotlib, an optional extra: pip install 'm3eagle[plot]' "
                          "(or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_acceptance(result: dict[str, Any], path: str | Path) -> Path:
    """A bar chart of the acceptance rate at each draft position, one bar group per position and one bar
    per K (from run_eval's code acceptance, or simulate_acceptance's result), written to `path` (PNG)."""
    plt = require_matplotlib()
    acc = result.get("code", {}).get("acceptance") or {k: v for k, v in result.items() if k.startswith("K=")}
    if not acc:
        raise ValueError("the eval result has no acceptance to plot (was a draft head given?)")
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(acc)
    for i, (name, a) in enumerate(sorted(acc.items(), key=lambda kv: int(kv[0][2:]))):
        rates = a["per_position_rates"]
        xs = [j + 1 + (i - (len(acc) - 1) / 2) * width for j in range(len(rates))]
        ax.bar(xs, rates, width, label=f"{name} (mean acceptance length {a['mean_acceptance_length']:.2f})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_xticks(range(1, max(len(a["per_position_rates"]) for a in acc.values()) + 1))
    ax.set_title("Eagle3 acceptance by draft position")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
