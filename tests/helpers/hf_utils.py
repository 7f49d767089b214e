"""Helpers that build tiny random MiniMax-M3 models with transformers (the parity oracle)."""

from __future__ import annotations

import torch


def tiny_hf_config(seed: int = 0, vocab: int = 96, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                   head_dim: int = 16, rotary_factor: float = 0.5, block: int = 8, topk: int = 2,
                   index_heads: int | None = None, experts: int = 4, top_k: int = 2, local_blocks: int = 1,
                   tie: bool = False, hidden: int = 48, inter: int = 24, dense_inter: int = 40, shared_inter: int = 20,
                   index_head_dim: int = 12):
    from transformers import MiniMaxM3VLTextConfig

    g = torch.Generator().manual_seed(seed)
    layer_types = ["full_attention"] + [
        "minimax_m3_sparse" if torch.rand((), generator=g) < 0.7 else "full_attention" for _ in range(layers - 1)]
    if "minimax_m3_sparse" not in layer_types:
        layer_types[-1] = "minimax_m3_sparse"
    mlp_types = ["dense"] + ["sparse" if torch.rand((), generator=g) < 0.7 else "dense" for _ in range(layers - 1)]
    if "sparse" not in mlp_types:
        mlp_types[-1] = "sparse"
    return MiniMaxM3VLTextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, dense_intermediate_size=dense_inter,
        shared_intermediate_size=shared_inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, num_local_experts=experts, num_experts_per_tok=top_k,
        routed_scaling_factor=2.0, rotary_dim=int(head_dim * rotary_factor), partial_rotary_factor=rotary_factor,
        rope_theta=10000.0, layer_types=layer_types, mlp_layer_types=mlp_types,
        index_n_heads=index_heads or kv_heads, index_head_dim=index_head_dim, index_block_size=block,
        index_topk_blocks=topk, index_local_blocks=local_blocks, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=tie, max_position_embeddings=4096, rms_norm_eps=1e-6)


def random_hf_model(cfg, seed: int = 0):
    from transformers import MiniMaxM3VLForCausalLM

    torch.manual_seed(seed)
    model = MiniMaxM3VLForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.2)  # exercise the (1 + w) Gemma scale
            elif p.dim() >= 2:
                p.normal_(0.0, 0.15)
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0.0, 0.3)
    return model
