"""Helpers for speculative-decoding tests: random and briefly trained Eagle3 heads."""

from __future__ import annotations

from pathlib import Path

import torch

from m3eagle.loader.checkpoint import load_target
from m3eagle.loader.eagle3 import save_eagle3
from m3eagle.models.eagle3 import Eagle3Config, Eagle3Head, default_aux_layer_ids


def random_head(target_dir: Path, out_dir: Path, seed: int = 0, draft_vocab: int | None = None,
                fc_norm: bool = False, norm_output: bool = False) -> Path:
    target = load_target(target_dir)
    tc = target.cfg
    cfg = Eagle3Config(hidden_size=tc.hidden_size, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=64, vocab_size=tc.vocab_size,
                       draft_vocab_size=draft_vocab or tc.vocab_size, rope_theta=10000.0,
                       aux_layer_ids=default_aux_layer_ids(tc.num_hidden_layers) if tc.num_hidden_layers >= 4
                       else tuple(range(1, tc.num_hidden_layers + 1))[:3],
                       fc_norm=fc_norm, norm_output=norm_output, has_embed=False)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for _, p in head.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
    if draft_vocab and draft_vocab < tc.vocab_size:
        g = torch.Generator().manual_seed(seed)
        head.set_vocab_mapping(torch.randperm(tc.vocab_size, generator=g)[:draft_vocab].sort().values)
    save_eagle3(head, out_dir)
    return out_dir


def trained_head(target_dir: Path, out_dir: Path, steps: int = 150, unroll: int = 3, seed: int = 0) -> Path:
    """A head trained for a few seconds on the target's own greedy continuations (training-time test
    unrolled over `unroll` draft steps), so that acceptance is high and a broken draft path shows."""
    from m3eagle import LLM, SamplingParams
    from m3eagle.loader.eagle3 import load_eagle3

    random_head(target_dir, out_dir, seed=seed)
    target = load_target(target_dir)
    head = load_eagle3(out_dir, target.cfg)
    head.set_embedding(target.embed_tokens.weight)
    head.train().requires_grad_(True)
    head.embed_tokens.requires_grad_(False) if head.embed_tokens is not None else None
    g = torch.Generator().manual_seed(seed)
    vocab = target.cfg.vocab_size
    prompts = [torch.randint(3, vocab, (6,), generator=g).tolist() for _ in range(48)]
    llm = LLM(target_dir, device="cpu", max_model_len=128, page_size=8, max_num_tokens=512)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    seqs = torch.tensor([o.prompt_token_ids + o.outputs[0].token_ids for o in outs])  # [N, 46]
    with torch.no_grad():
        hidden, aux = target.forward_seq(seqs, head.cfg.aux_layer_ids)
        labels = target.compute_logits(hidden).argmax(-1)  # [N, S] target's next-token choice
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    s_len = seqs.shape[1]
    for _ in range(steps):
        idx = torch.randint(0, seqs.shape[0], (16,), generator=g)
        cache: list = []
        h = aux[idx, : s_len - unroll - 1]
        loss = 0.0
        for s in range(unroll):
            ids_in = seqs[idx, s + 1: s_len - unroll + s]
            h_out, h = head.forward_seq(ids_in, h, from_aux=(s == 0), cache_kv=cache)
            logits = head.compute_logits(h_out)
            tgt = labels[idx, s + 1: s_len - unroll + s]
            loss = loss + torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval()
    save_eagle3(head, out_dir)
    return out_dir


def predictable_target(target_dir: Path, out_dir: Path, steps: int = 120, seed: int = 0) -> Path:
    """Train the tiny random target briefly on a language whose next token is a fixed permutation of
    the current one, so that its greedy continuations are learnable by a draft head (a random
    target's argmax is chaotic and caps any drafter's acceptance near zero)."""
    from m3eagle.loader.checkpoint import save_target

    target = load_target(target_dir)
    target.train().requires_grad_(True)
    vocab = target.cfg.vocab_size
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=g)
    opt = torch.optim.AdamW(target.parameters(), lr=3e-3)
    for _ in range(steps):
        x = torch.empty(16, 48, dtype=torch.int64)
        x[:, 0] = torch.randint(0, vocab, (16,), generator=g)
        for i in range(1, 48):
            x[:, i] = perm[x[:, i - 1]]
        hidden, _ = target.forward_seq(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(target.compute_logits(hidden).reshape(-1, vocab),
                                                 x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    target.eval()
    save_target(target, out_dir)
    return out_dir
