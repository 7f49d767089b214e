"""Pieces the training stages and the evaluation share: device and precision, greedy decoding by
recomputation, seeded batches, the LR schedule, a resumable training state, a JSONL log, and sizing a run
to a wall-clock budget."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


def pick_device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast(device: torch.device, amp: str) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA by default ('auto'); fp32 on CPU, where bf16 matmuls are slow."""
    on = amp == "bf16" or (amp == "auto" and device.type == "cuda")
    if not on:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


@torch.no_grad()
def greedy_continue(model, ids: torch.Tensor, n: int, device: torch.device, amp: str = "auto",
                    ) -> torch.Tensor:
    """Greedy continuation by recomputation (no cache): ids [B, P] -> [B, P + n]. The oracle the
    engine-free acceptance estimate decodes with, and the self-distillation pool's generator."""
    x = ids.to(device)
    for _ in range(n):
        with autocast(device, amp):
            hidden, _ = model.forward_seq(x)
            nxt = model.compute_logits(hidden[:, -1]).argmax(-1, keepdim=True)
        x = torch.cat([x, nxt], dim=1)
    return x


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def sample_batch(tokens: np.ndarray, batch: int, seq_len: int, seed: int, step: int,
                 device: torch.device) -> torch.Tensor:
    """[batch, seq_len + 1] random windows of the token stream. A pure function of (seed, step), so a
    resumed run sees exactly the batches the uninterrupted one would have."""
    rng = np.random.default_rng([seed, step])
    if tokens.size <= seq_len + 1:
        raise ValueError(f"the token array holds {tokens.size} tokens, fewer than seq_len+1={seq_len + 1}; "
                         "build a larger corpus or lower --seq-len")
    starts = rng.integers(0, tokens.size - seq_len - 1, size=batch)
    rows = np.stack([np.asarray(tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts])
    t = torch.from_numpy(rows)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float = 0.1) -> float:
    """Linear warmup, then cosine decay to final_frac * peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only; norms, biases and 1-D tensors are not decayed."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class JsonlLog:
    """Append-only log of dicts; survives a resume (it keeps appending)."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, rec: dict[str, Any]) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(rec) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


@dataclass
class RunState:
    """What a stage needs to continue after an interruption."""

    step: int
    total_steps: int
    elapsed_s: float


def save_state(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, state: RunState,
               extra: dict[str, Any] | None = None) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": state.step,
                "total_steps": state.total_steps, "elapsed_s": state.elapsed_s, "extra": extra or {}}, tmp)
    os.replace(tmp, path)


def load_state(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[RunState, dict]:
    ck = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    return RunState(ck["step"], ck["total_steps"], ck["elapsed_s"]), ck.get("extra", {})


def resolve_total_steps(steps: int | None, time_budget_s: float | None, step_fn, probe_steps: int,
                        device: torch.device) -> tuple[int, list[Any]]:
    """Fixed --steps, or size the run to --time-budget by timing `probe_steps` real steps first.

    Returns (total steps, the probe steps' results). The probe steps are real training steps (step
    0..probe_steps-1), so none of that time is wasted; the resolved total is logged and saved in the
    resumable state, which is what makes the run reproducible afterwards with --steps."""
    if steps is not None:
        return steps, []
    if time_budget_s is None:
        raise ValueError("pass --steps N or --time-budget SECONDS")
    results = []
    t0 = None
    for i in range(probe_steps):
        if i == 2:  # the first steps pay for allocator warm-up and kernel selection
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        results.append(step_fn(i))
    if device.type == "cuda":
        torch.cuda.synchronize()
    per_step = (time.perf_counter() - t0) / max(1, probe_steps - 2)
    return max(probe_steps + 1, int(time_budget_s / per_step)), results
