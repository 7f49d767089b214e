"""Target pretraining: a tiny MiniMax-M3 (dense full-attention layer first, then MoE + sparse attention).

The training forward (`train_forward`) is the same math as `MiniMaxM3.forward_seq` (a test holds the
two equal) with three additions that only training needs:

- Indexer loss. Top-k block selection passes no gradient to the lightning indexer, so it is trained
  on its own objective, as DeepSeek-V3.2's DSA indexer is: per query token and index head, the KL from
  the main attention's probability mass per key block (dense causal attention of the layer's own q/k,
  summed over the query heads the index head serves, detached) to the softmax of the indexer's
  block-max scores. The indexer reads a detached copy of the layer input, so this loss shapes the
  indexer only and the language-model loss never sees it.
- Dense warm-up. For the first `dense_warmup` steps sparse layers attend densely while the indexer
  learns what to pick (DSA's warm-up stage); after that they attend to the indexer's top-k blocks.
- Router balance without an auxiliary loss (DeepSeek-V3): after each step every MoE layer's
  `e_score_correction_bias` moves by `bias_update_rate` towards under-loaded experts. The router runs
  in fp32 outside autocast, as at inference.

Output directory:

    state.pt        model + optimizer + step (resume point, written every --save-every steps)
    log.jsonl       one record per logged step: loss, lm loss, indexer KL, lr, tokens/s
    final/          config.json + model.safetensors (bf16, routers fp32) + tokenizer.json
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from m3eagle.config import DENSE_MLP, FULL, MOE_MLP, SPARSE, M3Config
from m3eagle.kernels.attention import reference
from m3eagle.kernels.fused.reference import apply_rope, rope_cos_sin
from m3eagle.loader.checkpoint import cast_model, save_target
from m3eagle.models.layers import SparseMoE
from m3eagle.models.minimax_m3 import Attention, MiniMaxM3
from m3eagle.training.common import (
    JsonlLog,
    RunState,
    autocast,
    load_state,
    lr_at,
    param_groups,
    pick_device,
    resolve_total_steps,
    sample_batch,
    save_state,
    seed_everything,
)
from m3eagle.training.tokenizer import load_tokens, write_hf_tokenizer_config

# ------------------------------------------------------------------------------------------------
# Model presets
# ------------------------------------------------------------------------------------------------


def model_config(preset: str, vocab_size: int, eos_id: int = 0) -> M3Config:
    """'default': the shipped model (~9M parameters); 'tiny': seconds-sized, for CPU tests.

    Layer 0 is dense MLP + full attention; the rest are MoE + MiniMax sparse attention with
    block 16 / top-4, so attention is sparse beyond 64 tokens of context."""
    presets = {
        "default": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, dense_intermediate_size=640, intermediate_size=160,
                        shared_intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                        index_head_dim=32),
        "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, dense_intermediate_size=128, intermediate_size=32,
                     shared_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                     index_head_dim=16),
    }
    if preset not in presets:
        raise ValueError(f"--preset {preset!r} is unknown; choose one of {sorted(presets)}")
    p = presets[preset]
    n = p["num_hidden_layers"]
    return M3Config(
        vocab_size=vocab_size, rotary_dim=p["head_dim"] // 2, rope_theta=10000.0, rms_norm_eps=1e-6,
        routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0,
        layer_types=(FULL,) + (SPARSE,) * (n - 1), mlp_layer_types=(DENSE_MLP,) + (MOE_MLP,) * (n - 1),
        index_n_heads=p["num_key_value_heads"], index_block_size=16, index_topk_blocks=4,
        index_local_blocks=1, tie_word_embeddings=False, bos_token_id=None, eos_token_ids=(eos_id,),
        max_position_embeddings=4096, **p)


def init_weights(model: MiniMaxM3, seed: int, std: float = 0.02) -> None:
    """GPT-2 style init: N(0, std) everywhere, output projections scaled by 1/sqrt(2 * layers) so the
    residual stream does not grow with depth; Gemma norms start at 0 (scale 1)."""
    g = torch.Generator().manual_seed(seed)
    out_std = std / math.sqrt(2 * model.cfg.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2:
                p.zero_()
                continue
            s = out_std if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")) else std
            p.copy_(torch.randn(p.shape, generator=g) * s)
        for m in model.modules():
            if isinstance(m, SparseMoE):
                m.gate.e_score_correction_bias.zero_()


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------------
# Training forward
# ------------------------------------------------------------------------------------------------


@dataclass
class ForwardStats:
    index_kl: list[torch.Tensor]  # one scalar per sparse layer
    expert_load: list[torch.Tensor]  # [E] token counts per MoE layer (for the bias update)


def _block_pad(x: torch.Tensor, block: int, value: float) -> torch.Tensor:
    pad = (-x.shape[-1]) % block
    return F.pad(x, (0, pad), value=value) if pad else x


def indexer_kl(q: torch.Tensor, k: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor, cfg: M3Config,
               scale: float) -> torch.Tensor:
    """KL(attention mass per key block || softmax of indexer block scores), averaged over query tokens
    and index heads. q [B, S, Hq, D], k [B, S, Hkv, D], iq [B, S, Hi, Di], ik [B, S, Di]."""
    b, s, hq, _ = q.shape
    hi, bs = cfg.index_n_heads, cfg.index_block_size
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()  # [q, k]
    with torch.no_grad():
        kk = k.float().repeat_interleave(hq // k.shape[2], dim=2)
        logits = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) * scale
        p = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)  # [B, Hq, S, S]
        p = p.view(b, hi, hq // hi, s, s).mean(2)  # query heads of one KV group share an index head
        target = _block_pad(p, bs, 0.0).view(b, hi, s, -1, bs).sum(-1)  # [B, Hi, S, nb]
    scores = torch.einsum("bqhd,bkd->bhqk", iq.float(), ik.float()).masked_fill(~causal, float("-inf"))
    block = _block_pad(scores, bs, float("-inf")).view(b, hi, s, -1, bs).amax(-1)  # [B, Hi, S, nb]
    logq = torch.log_softmax(block, dim=-1)
    live = target > 0  # blocks wholly in the future have zero mass (and -inf score): no term
    kl = torch.where(live, target * (torch.log(target.clamp_min(1e-30)) - logq), torch.zeros_like(logq))
    return kl.sum(-1).mean()


def _attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sparse: bool,
               stats: ForwardStats | None) -> torch.Tensor:
    """Attention.forward_seq, plus the indexer loss and the dense warm-up switch. x [B, S, H]."""
    b, s, c = x.shape[0], x.shape[1], attn.cfg
    flat = x.reshape(b * s, -1)
    cos_f, sin_f = cos.repeat(b, 1), sin.repeat(b, 1)
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    q = apply_rope(attn.q_norm(attn.q_proj(flat).view(b * s, hq, d)), cos_f, sin_f)
    k = apply_rope(attn.k_norm(attn.k_proj(flat).view(b * s, hkv, d)), cos_f, sin_f)
    v = attn.v_proj(flat).view(b, s, c.num_key_value_heads, c.head_dim)
    q = q.view(b, s, c.num_attention_heads, c.head_dim)
    k = k.view(b, s, c.num_key_value_heads, c.head_dim)
    keep = None
    if attn.indexer is not None:
        # Detached input: the indexer loss trains the indexer only.
        iq, ik = attn.indexer(flat.detach(), cos_f, sin_f)
        iq, ik = iq.view(b, s, c.index_n_heads, -1), ik.view(b, s, -1)
        if stats is not None:
            stats.index_kl.append(indexer_kl(q, k, iq, ik, c, attn.scale))
        if sparse:
            with torch.no_grad():
                pos = torch.arange(s, device=x.device).expand(b, s)
                sel = reference.select_blocks(iq, ik, pos, c.index_block_size, c.index_topk_blocks,
                                              c.index_local_blocks)
                keep = reference.block_keep_mask(sel, s, c.index_block_size, c.num_attention_heads)
    # reference.attend's math, with K/V expanded to the query heads (GQA) so CUDA's fused kernels take it:
    # flash with is_causal when dense, mem-efficient with a [B, Hq, S, S] mask when sparse.
    rep = hq // hkv
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
    if keep is None:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=attn.scale)
    else:
        keep = keep & torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=keep, scale=attn.scale)
    return attn.o_proj(o.transpose(1, 2).reshape(b, s, -1))


def _moe(moe: SparseMoE, x: torch.Tensor, stats: ForwardStats | None) -> torch.Tensor:
    """SparseMoE.forward with the router in fp32 outside autocast (as at inference). x [T, H]."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        w, idx = moe.gate(x.float())
    if stats is not None:
        stats.expert_load.append(torch.bincount(idx.flatten(), minlength=moe.gate.weight.shape[0]))
    return moe.experts(x, w, idx) * moe.routed_scaling_factor + moe.shared_experts(x)


def train_forward(model: MiniMaxM3, input_ids: torch.Tensor, sparse: bool = True,
                  stats: ForwardStats | None = None) -> torch.Tensor:
    """input_ids [B, S] -> hidden [B, S, H] after the final norm (same math as forward_seq)."""
    x = model.embed_tokens(input_ids)
    pos = torch.arange(input_ids.shape[1], device=input_ids.device)
    cos, sin = rope_cos_sin(pos, model.cfg.rotary_dim, model.cfg.rope_theta, x.dtype)
    b, s, h = x.shape
    for layer in model.layers:
        x = x + _attention(layer.self_attn, layer.input_layernorm(x), cos, sin, sparse, stats)
        y = layer.post_attention_layernorm(x).reshape(b * s, h)
        y = _moe(layer.mlp, y, stats) if isinstance(layer.mlp, SparseMoE) else layer.mlp(y)
        x = x + y.view(b, s, h)
    return model.norm(x)


def update_router_bias(model: MiniMaxM3, loads: list[torch.Tensor], rate: float) -> None:
    """Aux-loss-free balancing: raise the bias of experts below the mean load, lower the others."""
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    with torch.no_grad():
        for moe, load in zip(moes, loads):
            load = load.float()
            moe.gate.e_score_correction_bias.add_(rate * torch.sign(load.mean() - load))


# ------------------------------------------------------------------------------------------------
# Loop
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetTrainConfig:
    preset: str = "default"
    steps: int | None = None  # None: size the run to time_budget_s
    time_budget_s: float | None = None
    batch_size: int = 128
    seq_len: int = 512
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dense_warmup: float = 0.05  # fraction of steps with dense attention in sparse layers
    index_loss_weight: float = 1.0
    bias_update_rate: float = 1e-3
    log_every: int = 25
    eval_every: int = 250
    save_every: int = 500
    eval_batches: int = 8
    seed: int = 0
    amp: str = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    device: str | None = None


def evaluate_loss(model: MiniMaxM3, tokens: np.ndarray, cfg: TargetTrainConfig, device: torch.device,
                  batches: int) -> float:
    """Mean next-token loss on `batches` seeded windows of a held-out array (sparse attention on)."""
    model.eval()
    losses = []
    with torch.no_grad(), autocast(device, cfg.amp):
        for i in range(batches):
            batch = sample_batch(tokens, min(cfg.batch_size, 32), cfg.seq_len, cfg.seed + 7919, i, device)
            hidden = train_forward(model, batch[:, :-1])
            logits = model.compute_logits(hidden)
            losses.append(F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item())
    model.train()
    return float(np.mean(losses))


def export_target(model: MiniMaxM3, out_dir: Path, tokenizer_dir: Path | None) -> None:
    """bf16 weights, fp32 routers (cast_model keeps them), config.json, and the tokenizer beside them."""
    m = cast_model(copy.deepcopy(model).cpu(), torch.bfloat16, "cpu")
    save_target(m, out_dir, layout="hf")
    if tokenizer_dir is not None:
        shutil.copy(Path(tokenizer_dir) / "tokenizer.json", out_dir / "tokenizer.json")
        write_hf_tokenizer_config(out_dir)


def train_target(data_dir: str | Path, out_dir: str | Path, cfg: TargetTrainConfig = TargetTrainConfig(),
                 ) -> Path:
    """Pretrain the target on data_dir's train.bin; returns the exported final/ directory."""
    data_dir, out = Path(data_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = json.loads((data_dir / "tokens.json").read_text())
    device = pick_device(cfg.device)
    seed_everything(cfg.seed)
    train, val = load_tokens(data_dir, "train"), load_tokens(data_dir, "val")
    mcfg = model_config(cfg.preset, meta["vocab_size"], meta["eos_id"])
    model = MiniMaxM3(mcfg)
    init_weights(model, cfg.seed)
    model.to(device).train()
    # The router stays fp32; everything else is fp32 master weights under bf16 autocast.
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")
    log = JsonlLog(out / "log.jsonl")
    state_path = out / "state.pt"
    state = RunState(0, cfg.steps or 0, 0.0)
    if state_path.is_file():
        state, _ = load_state(state_path, model, opt)
        print(f"train-target: resuming {out} at step {state.step}/{state.total_steps}")
    n_params = count_params(model)
    print(f"train-target: {n_params / 1e6:.2f}M parameters, device={device}, "
          f"batch={cfg.batch_size}x{cfg.seq_len}")

    tokens_per_step = cfg.batch_size * cfg.seq_len

    def step_fn(step: int, total: int, sparse: bool | None = None) -> dict:
        lr = lr_at(step, total, cfg.lr, cfg.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = sample_batch(train, cfg.batch_size, cfg.seq_len, cfg.seed, step, device)
        stats = ForwardStats([], [])
        if sparse is None:
            sparse = step >= int(cfg.dense_warmup * total)
        with autocast(device, cfg.amp):
            hidden = train_forward(model, batch[:, :-1], sparse=sparse, stats=stats)
            logits = model.compute_logits(hidden)
        lm = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        kl = torch.stack(stats.index_kl).mean() if stats.index_kl else lm.new_zeros(())
        loss = lm + cfg.index_loss_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        update_router_bias(model, stats.expert_load, cfg.bias_update_rate)
        return {"step": step, "lr": lr, "loss": lm.detach(), "index_kl": kl.detach(), "grad_norm": gnorm,
                "sparse": sparse}

    t_start = time.perf_counter() - state.elapsed_s
    if state.step == 0 and state.total_steps == 0:
        probe = 12
        # Probe steps run sparse (the slower kind) so the time budget is not overrun; they fall in
        # the LR warm-up, whose length does not depend on the total.
        est_total, probe_out = resolve_total_steps(cfg.steps, cfg.time_budget_s,
                                                   lambda i: step_fn(i, 10**9, sparse=True), probe, device)
        state.total_steps = est_total
        state.step = len(probe_out)
        for r in probe_out:
            if r["step"] % cfg.log_every == 0:
                log.write(_record(r, None))
        print(f"train-target: {state.total_steps} steps "
              f"({state.total_steps * tokens_per_step / 1e6:.0f}M tokens)")
    total = state.total_steps
    bar = tqdm(total=total, initial=state.step, desc="train-target", unit="step", mininterval=2.0,
               dynamic_ncols=True)
    t_log = time.perf_counter()
    tokens_since = 0
    for step in range(state.step, total):
        r = step_fn(step, total)
        tokens_since += tokens_per_step
        bar.update(1)
        last = step == total - 1
        if step % cfg.log_every == 0 or last:
            now = time.perf_counter()
            rec = _record(r, tokens_since / max(1e-9, now - t_log))
            t_log, tokens_since = now, 0
            if step % cfg.eval_every == 0 or last:
                rec["val_loss"] = evaluate_loss(model, val, cfg, device, cfg.eval_batches)
            rec["elapsed_s"] = time.perf_counter() - t_start
            log.write(rec)
            bar.set_postfix_str(f"loss {rec['loss']:.3f} kl {rec['index_kl']:.3f}"
                                + (f" val {rec['val_loss']:.3f}" if "val_loss" in rec else ""))
        over = cfg.time_budget_s is not None and time.perf_counter() - t_start > 1.15 * cfg.time_budget_s
        if over and not last:
            # NOTE: a hard stop keeps a device call inside its limit; the LR schedule is cut short.
            print(f"train-target: time budget exceeded at step {step + 1}/{total}; stopping early")
            log.write({"step": step, "stopped_early": True, "val_loss": evaluate_loss(model, val, cfg, device,
                                                                                       cfg.eval_batches)})
            last = True
        if (step + 1) % cfg.save_every == 0 or last:
            save_state(state_path, model, opt, RunState(step + 1, total, time.perf_counter() - t_start),
                       {"config": asdict(cfg), "model_config": mcfg.to_hf_text_dict()})
        if last:
            total = step + 1
            break
    bar.close()
    final = out / "final"
    export_target(model, final, data_dir)
    summary = {"params": n_params, "steps": total, "tokens": total * tokens_per_step,
               "train_config": asdict(cfg), "wall_s": time.perf_counter() - t_start,
               "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return final


def _record(r: dict, tok_s: float | None) -> dict:
    rec = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in r.items()}
    if tok_s is not None:
        rec["tokens_per_s"] = tok_s
    return rec
