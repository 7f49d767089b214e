"""Eagle3 head training against the frozen target, with training-time test (TTT) unrolling.

Every step the target runs on a batch (no grad, bf16 autocast on CUDA) and yields, online, the aux
hidden states the head reads and the logits it imitates. The head then unrolls `ttt_steps` draft steps
(SpecForge's recipe, `Eagle3Head.forward_seq` with a shared `cache_kv`):

    step s, index i:  token  = input_ids[i + 1 + s]            (teacher-forced chain tokens)
                      hidden = fc(aux[i]) if s == 0 else h_next of step s-1 at i
                      target = softmax(target_logits[i + 1 + s] over the draft vocabulary)
    loss = sum_s 0.8^s * soft cross-entropy(step s), on indices whose target argmax the draft
           vocabulary holds (a token it cannot emit teaches nothing)

The draft vocabulary is the `draft_vocab_size` most frequent target tokens of the training stream
(EOS always in), stored as d2t / t2d. The head shares the target's embedding table (frozen, not saved),
so it is saved without embed_tokens.

Output directory:

    state.pt        head + optimizer + step (resume point)
    log.jsonl       per logged step: loss and top-1 agreement with the target per TTT step
    final/          config.json + model.safetensors (bf16), the Eagle3 layout load_eagle3 reads
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from m3eagle.loader.checkpoint import load_target
from m3eagle.loader.eagle3 import load_eagle3, save_eagle3
from m3eagle.models.eagle3 import Eagle3Config, Eagle3Head, default_aux_layer_ids
from m3eagle.models.minimax_m3 import MiniMaxM3
from m3eagle.training.common import (
    JsonlLog,
    RunState,
    autocast,
    greedy_continue,
    load_state,
    lr_at,
    param_groups,
    pick_device,
    resolve_total_steps,
    sample_batch,
    save_state,
    seed_everything,
)
from m3eagle.training.tokenizer import load_tokens


@dataclass(frozen=True)
class DraftTrainConfig:
    steps: int | None = None  # None: size the run to time_budget_s
    time_budget_s: float | None = None
    batch_size: int = 64
    seq_len: int = 512
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    ttt_steps: int = 5  # drafting depth trained for (eval uses K <= 5)
    step_decay: float = 0.8  # loss weight of TTT step s is step_decay ** s
    draft_vocab_size: int = 4096
    intermediate_size: int = 768
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    log_every: int = 25
    eval_every: int = 200
    save_every: int = 500
    eval_batches: int = 4
    seed: int = 0
    amp: str = "auto"
    device: str | None = None
    init_from: str | None = None  # an Eagle3 checkpoint to continue from (its vocab mapping is kept)
    # Self-distillation: a pool of rows whose second half is the target's own greedy continuation of a
    # corpus window -- the distribution the head meets at inference. Each step adds one such batch.
    self_distill_rows: int = 0
    self_distill_batch: int = 64
    self_distill_prompt: int = 64
    self_distill_gen: int = 64


def aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """Low / middle / high residual streams. The vLLM default (2, N//2, N-3) repeats a layer for
    N < 8 (N=6 gives (2, 3, 3)); then spread them as (1, N//2, N-1) instead."""
    ids = default_aux_layer_ids(num_layers)
    if len(set(ids)) == len(ids):
        return ids
    return (1, num_layers // 2, num_layers - 1)


def draft_vocab(tokens: np.ndarray, vocab_size: int, draft_vocab_size: int, eos_id: int) -> torch.Tensor:
    """The draft_vocab_size most frequent ids of the token stream (EOS always kept), ascending."""
    counts = np.bincount(np.asarray(tokens), minlength=vocab_size).astype(np.int64)
    counts[eos_id] = counts.max() + 1
    top = np.argsort(-counts, kind="stable")[:draft_vocab_size]
    return torch.from_numpy(np.sort(top)).long()


def build_head(target: MiniMaxM3, cfg: DraftTrainConfig, vocab_ids: torch.Tensor, seed: int) -> Eagle3Head:
    t = target.cfg
    hcfg = Eagle3Config(hidden_size=t.hidden_size, num_attention_heads=cfg.num_attention_heads,
                        num_key_value_heads=cfg.num_key_value_heads, intermediate_size=cfg.intermediate_size,
                        vocab_size=t.vocab_size, draft_vocab_size=cfg.draft_vocab_size,
                        head_dim=t.hidden_size // cfg.num_attention_heads, rms_norm_eps=t.rms_norm_eps,
                        rope_theta=10000.0, max_position_embeddings=t.max_position_embeddings,
                        aux_layer_ids=aux_layer_ids(t.num_hidden_layers), target_hidden_size=t.hidden_size,
                        fc_norm=True, norm_output=False, has_embed=False)
    head = Eagle3Head(hcfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            # LlamaRMSNorm weights start at 1 (their constructor value)
    head.set_vocab_mapping(vocab_ids)
    return head


def shift_left(x: torch.Tensor, n: int, fill: float | int = 0) -> torch.Tensor:
    """x[:, n:] padded on the right with `fill` back to x's length (dim 1)."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], n, *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


@dataclass
class TTTOutput:
    loss: torch.Tensor  # weighted sum over steps
    step_loss: list[torch.Tensor]
    step_acc: list[torch.Tensor]  # top-1 agreement with the target's argmax, per step
    draft_argmax: list[torch.Tensor]  # [B, S] target ids the head would draft at step s, index i


def ttt_forward(target: MiniMaxM3, head: Eagle3Head, input_ids: torch.Tensor, steps: int, decay: float,
                device: torch.device, amp: str) -> TTTOutput:
    """One TTT unroll over input_ids [B, S]; the target is frozen and read online."""
    vocab_ids = torch.arange(head.cfg.draft_vocab_size, device=input_ids.device) + head.d2t
    b, s = input_ids.shape
    with torch.no_grad(), autocast(device, amp):
        hidden, aux = target.forward_seq(input_ids, head.cfg.aux_layer_ids)
        tlogits = target.compute_logits(hidden)  # [B, S, V] fp32
    targmax = tlogits.argmax(-1)  # [B, S] target ids
    tprob = torch.softmax(tlogits[..., vocab_ids], dim=-1)  # renormalised over the draft vocab [B, S, Vd]
    in_vocab = head.t2d[targmax]
    idx = torch.arange(s, device=input_ids.device)
    cache: list = []
    h, from_aux = aux, True
    out = TTTOutput(input_ids.new_zeros((), dtype=torch.float32), [], [], [])
    for st in range(steps):
        with autocast(device, amp):
            tokens = shift_left(input_ids, 1 + st)
            h_out, h_next = head.forward_seq(tokens, h, from_aux=from_aux, cache_kv=cache)
            logits = head.compute_logits(h_out)  # [B, S, Vd] fp32
        mask = (idx < s - 1 - st)[None, :] & shift_left(in_vocab, 1 + st, False)  # [B, S]
        tgt = shift_left(tprob, 1 + st)
        ce = -(tgt * torch.log_softmax(logits, -1)).sum(-1)  # [B, S]
        denom = mask.sum().clamp_min(1)
        loss = (ce * mask).sum() / denom
        pred = head.draft_to_target(logits.argmax(-1))
        acc = ((pred == shift_left(targmax, 1 + st, -1)) & mask).sum() / denom
        out.loss = out.loss + decay ** st * loss
        out.step_loss.append(loss.detach())
        out.step_acc.append(acc.detach())
        out.draft_argmax.append(pred.detach())
        h, from_aux = h_next, False
    return out


def evaluate_head(target: MiniMaxM3, head: Eagle3Head, tokens: np.ndarray, cfg: DraftTrainConfig,
                  device: torch.device, batches: int) -> dict:
    head.eval()
    accs, losses = [], []
    with torch.no_grad():
        for i in range(batches):
            batch = sample_batch(tokens, min(cfg.batch_size, 32), cfg.seq_len, cfg.seed + 7919, i, device)
            o = ttt_forward(target, head, batch[:, :-1], cfg.ttt_steps, cfg.step_decay, device, cfg.amp)
            accs.append([a.item() for a in o.step_acc])
            losses.append(o.loss.item())
    head.train()
    return {"val_loss": float(np.mean(losses)), "val_step_acc": np.mean(accs, axis=0).round(4).tolist()}


@torch.no_grad()
def self_distill_pool(target: MiniMaxM3, tokens: np.ndarray, cfg: DraftTrainConfig, device: torch.device,
                      out: Path) -> torch.Tensor:
    """[rows, prompt + gen] token rows: a seeded corpus window, then the target's greedy continuation.
    Cached in out/ so a resumed run reuses it."""
    cache = out / "self_distill.npy"
    if cache.is_file():
        return torch.from_numpy(np.load(cache)).to(device)
    rows = []
    chunk = 1024
    for i in tqdm(range(0, cfg.self_distill_rows, chunk), desc="train-draft: self-distill pool", mininterval=2.0,
                  dynamic_ncols=True):
        n = min(chunk, cfg.self_distill_rows - i)
        prompt = sample_batch(tokens, n, cfg.self_distill_prompt - 1, cfg.seed + 104729, i, device)
        rows.append(greedy_continue(target, prompt, cfg.self_distill_gen, device, cfg.amp).cpu())
    pool = torch.cat(rows)
    np.save(cache, pool.numpy())
    return pool.to(device)


def train_draft(data_dir: str | Path, target_dir: str | Path, out_dir: str | Path,
                cfg: DraftTrainConfig = DraftTrainConfig()) -> Path:
    """Train the Eagle3 head for the target at target_dir; returns the exported final/ directory."""
    data_dir, out = Path(data_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = json.loads((Path(data_dir) / "tokens.json").read_text())
    device = pick_device(cfg.device)
    seed_everything(cfg.seed)
    train, val = load_tokens(data_dir, "train"), load_tokens(data_dir, "val")
    # fp32 master copy of the (bf16-stored) target; autocast runs it in bf16 on CUDA.
    target = load_target(target_dir, torch.float32, device)
    if target.cfg.vocab_size != meta["vocab_size"]:
        raise ValueError(f"target vocab_size={target.cfg.vocab_size} but the token arrays in {data_dir} use "
                         f"{meta['vocab_size']}; train the head on the target's own data directory")
    if cfg.init_from:
        head = load_eagle3(cfg.init_from, target.cfg, torch.float32, "cpu").requires_grad_(True)
        print(f"train-draft: continuing from {cfg.init_from}")
    else:
        head = build_head(target, cfg, draft_vocab(train, target.cfg.vocab_size, cfg.draft_vocab_size,
                                                   meta["eos_id"]), cfg.seed)
    head.set_embedding(target.embed_tokens.weight)  # frozen (the target's is requires_grad False)
    head.to(device).train()
    opt = torch.optim.AdamW(param_groups(head, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    log = JsonlLog(out / "log.jsonl")
    state_path = out / "state.pt"
    state = RunState(0, cfg.steps or 0, 0.0)
    if state_path.is_file():
        state, _ = load_state(state_path, head, opt)
        print(f"train-draft: resuming {out} at step {state.step}/{state.total_steps}")
    n_params = sum(p.numel() for n, p in head.named_parameters() if not n.startswith("embed_tokens"))
    print(f"train-draft: {n_params / 1e6:.2f}M parameters (without the shared embedding), device={device}, "
          f"batch={cfg.batch_size}x{cfg.seq_len}, ttt_steps={cfg.ttt_steps}")

    pool = self_distill_pool(target, train, cfg, device, out) if cfg.self_distill_rows else None

    def step_fn(step: int, total: int) -> dict:
        lr = lr_at(step, total, cfg.lr, cfg.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = sample_batch(train, cfg.batch_size, cfg.seq_len, cfg.seed, step, device)
        o = ttt_forward(target, head, batch[:, :-1], cfg.ttt_steps, cfg.step_decay, device, cfg.amp)
        loss = o.loss
        if pool is not None:
            rows = np.random.default_rng([cfg.seed, step, 1]).integers(0, pool.shape[0], cfg.self_distill_batch)
            sd = ttt_forward(target, head, pool[torch.from_numpy(rows).to(pool.device)], cfg.ttt_steps,
                             cfg.step_decay, device, cfg.amp)
            loss = 0.5 * (loss + sd.loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
        opt.step()
        return {"step": step, "lr": lr, "loss": loss.detach(), "grad_norm": gnorm,
                "step_acc": torch.stack(o.step_acc)}

    t_start = time.perf_counter() - state.elapsed_s
    if state.step == 0 and state.total_steps == 0:
        total, probe_out = resolve_total_steps(cfg.steps, cfg.time_budget_s, lambda i: step_fn(i, 10**9),
                                               10, device)
        state = RunState(len(probe_out), total, 0.0)
        print(f"train-draft: {total} steps")
    total = state.total_steps
    bar = tqdm(total=total, initial=state.step, desc="train-draft", unit="step", mininterval=2.0,
               dynamic_ncols=True)
    for step in range(state.step, total):
        r = step_fn(step, total)
        bar.update(1)
        last = step == total - 1
        if cfg.time_budget_s is not None and time.perf_counter() - t_start > 1.15 * cfg.time_budget_s:
            print(f"train-draft: time budget exceeded at step {step + 1}/{total}; stopping early")
            last = True
        if step % cfg.log_every == 0 or last:
            rec = {"step": step, "lr": r["lr"], "loss": r["loss"].item(), "grad_norm": r["grad_norm"].item(),
                   "step_acc": [round(a, 4) for a in r["step_acc"].tolist()],
                   "elapsed_s": time.perf_counter() - t_start}
            if step % cfg.eval_every == 0 or last:
                rec.update(evaluate_head(target, head, val, cfg, device, cfg.eval_batches))
            log.write(rec)
            bar.set_postfix_str(f"loss {rec['loss']:.3f} acc0 {rec['step_acc'][0]:.3f}")
        if (step + 1) % cfg.save_every == 0 or last:
            save_state(state_path, head, opt, RunState(step + 1, total, time.perf_counter() - t_start),
                       {"config": asdict(cfg)})
        if last:
            total = step + 1
            break
    bar.close()
    final = out / "final"
    save_eagle3(head, final, layout="midlayer", dtype=torch.bfloat16)
    summary = {"params": n_params, "steps": total, "train_config": asdict(cfg),
               "wall_s": time.perf_counter() - t_start, "target": str(target_dir),
               "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return final
