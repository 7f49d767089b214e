"""Eagle3 draft head: one Llama-style decoder layer over (token embedding, fused target features).

Parameter names are the EAGLE / SpecForge checkpoint names, so `state_dict()` maps 1:1 onto a
`LlamaForCausalLMEagle3` checkpoint:

    embed_tokens.weight                [V, H]      (absent when the head shares the target's table)
    fc.weight                          [H, n_aux * Ht]
    fc_norm.{i}.weight                 [Ht]        (Eagle3.1 only, one per aux chunk i, in aux order)
    midlayer.input_layernorm.weight    [H]         (normalises the token embedding)
    midlayer.hidden_norm.weight        [H]         (normalises the hidden input)
    midlayer.self_attn.{q,k,v}_proj    [*, 2H]     (input: concat(embed part, hidden part))
    midlayer.self_attn.o_proj          [H, heads * D]
    midlayer.post_attention_layernorm  [H]
    midlayer.mlp.{gate,up,down}_proj   SiLU MLP
    norm.weight                        [H]
    lm_head.weight                     [Vd, H]     (absent when the head shares the target's lm_head: Vd == V)
    d2t                                [Vd] int64  target id = draft id + d2t[draft id]
    t2d                                [V] bool    target id is in the draft vocabulary

One draft step (`forward`):

    h0        = fc(concat_i fc_norm_i(aux_i))   if the hidden comes from the target (step 0)
              = h_next of the previous step      otherwise
    x         = concat(input_layernorm(embed(tok)), hidden_norm(h0))          # [T, 2H]
    h         = h0 + o_proj(attn(q(x), k(x), v(x)))       # the residual stream is the *hidden* input
    h         = h + mlp(post_attention_layernorm(h))
    h_out     = norm(h)                                   # -> lm_head (draft logits)
    h_next    = h (Eagle3) or h_out (Eagle3.1 `norm_output`)   # -> the next draft step

Like the target, the module holds weights only: `forward` is a pure function of (tokens, positions,
hidden, metadata, cache); the engine owns the draft layer's K/V pool, indexed by the same slots as the
target's, and its ops (`meta.ops`) run the paged path's attention and fused norms / RoPE / activations.
`forward_seq` is the contiguous training path, with the training-time-test (TTT) unrolling.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn

from m3eagle.distributed.layers import linear
from m3eagle.kernels.attention import reference
from m3eagle.kernels.attention.metadata import AttnMetadata
from m3eagle.kernels.fused.reference import apply_rope, rope_cos_sin
from m3eagle.kernels.ops import REFERENCE
from m3eagle.models.layers import LlamaRMSNorm, PackedLinears, SiluMLP
from m3eagle.models.minimax_m3 import LayerCache

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """Aux capture ids for an N-layer target when the draft config names none: the residual stream
    after 2, N//2 and N-3 layers (vLLM / TRT-LLM / sglang's fallback)."""
    if num_layers < 4:
        raise ValueError(f"default Eagle3 aux layers need a target with >= 4 layers, got num_hidden_layers="
                         f"{num_layers}; set eagle_config.eagle_aux_hidden_state_layer_ids explicitly")
    return (2, num_layers // 2, num_layers - 3)


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int  # H: the draft layer's width
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  # V: the target vocabulary (embedding rows, t2d length)
    draft_vocab_size: int  # Vd: lm_head rows, d2t length
    head_dim: int = 0  # config.json's head_dim when given; 0 -> hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    # Target layers whose residual stream feeds fc, in concat order ("after L layers", see
    # MiniMaxM3.forward). None: the loader fills in default_aux_layer_ids(N) for the target.
    aux_layer_ids: tuple[int, ...] | None = None
    target_hidden_size: int = 0  # Ht: width of one aux chunk; 0 -> hidden_size
    fc_norm: bool = False  # Eagle3.1: RMSNorm per aux chunk before fc
    norm_output: bool = False  # Eagle3.1: the next step's hidden is taken after the final norm
    has_embed: bool = True  # False: the checkpoint has no embed_tokens; share the target's table
    # False: the checkpoint has no lm_head (draft vocabulary == the target's); share the target's lm_head
    # (`Eagle3Head.set_lm_head`, or `loader.eagle3.share_target_weights` for both tables)
    has_lm_head: bool = True

    def __post_init__(self) -> None:
        # Frozen dataclass: resolve the "0 means derived" defaults once, so equality and to_dict see
        # concrete values.
        for key in ("hidden_size", "num_attention_heads", "num_key_value_heads"):
            if getattr(self, key) <= 0:
                raise ValueError(f"Eagle3 config {key}={getattr(self, key)} must be positive")
        if self.head_dim < 0:
            raise ValueError(f"Eagle3 config head_dim={self.head_dim} must be positive")
        if not self.head_dim:
            # Only when config.json names no head_dim: a given head_dim is never re-derived (a head whose
            # heads x head_dim differs from hidden_size is legal, e.g. 64 x 128 over 6144).
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"Eagle3 config has no head_dim and hidden_size={self.hidden_size} is not a "
                                 f"multiple of num_attention_heads={self.num_attention_heads}; set head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not self.target_hidden_size:
            object.__setattr__(self, "target_hidden_size", self.hidden_size)
        if self.aux_layer_ids is not None:
            object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")

    # ---- derived -------------------------------------------------------------------------------
    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids) if self.aux_layer_ids is not None else 3

    @property
    def aux_hidden_size(self) -> int:
        """Width of the concatenated aux input to fc: n_aux * Ht."""
        return self.num_aux * self.target_hidden_size

    # ---- parsing -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Eagle3Config:
        """Parse a `LlamaForCausalLMEagle3`-style config.json (EAGLE, SpecForge, speculators)."""
        for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
            if d.get(key) is None:
                raise ValueError(f"Eagle3 config.json has no {key!r}; it is required for a "
                                 f"{ARCHITECTURE} head")
        _reject_unsupported(d)
        eagle = dict(d.get("eagle_config") or {})
        fc_norm = _flag(d, eagle, "fc_norm")
        norm_output = _flag(d, eagle, "norm_output")
        aux = _aux_ids(d, eagle)
        rope = dict(d.get("rope_parameters") or {})
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        heads = int(d["num_attention_heads"])
        vocab = int(d["vocab_size"])
        kv_heads = d.get("num_key_value_heads")  # absent / null: multi-head attention (one KV head per head)
        if kv_heads is not None and (int(kv_heads) <= 0 or heads % int(kv_heads)):
            raise ValueError(f"Eagle3 config num_key_value_heads={kv_heads} must be positive and divide "
                             f"num_attention_heads={heads} (MHA: equal, or leave it out; GQA: a divisor)")
        return cls(
            hidden_size=int(d["hidden_size"]), num_attention_heads=heads,
            num_key_value_heads=int(kv_heads) if kv_heads is not None else heads,
            head_dim=int(d.get("head_dim") or 0), intermediate_size=int(d["intermediate_size"]),
            vocab_size=vocab, draft_vocab_size=int(d.get("draft_vocab_size") or vocab),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            aux_layer_ids=tuple(aux) if aux is not None else None,
            target_hidden_size=int(d.get("target_hidden_size") or 0),
            fc_norm=fc_norm, norm_output=norm_output, has_embed=bool(eagle.get("has_embed", True)),
            has_lm_head=bool(eagle.get("has_lm_head", True)))

    def to_dict(self) -> dict[str, Any]:
        """A config.json that `from_dict`, SpecForge, sglang and vLLM read. fc_norm / norm_output are
        written both top-level (where vLLM / sglang look) and under eagle_config."""
        d = asdict(self)
        aux, has_embed, has_lm_head = d.pop("aux_layer_ids"), d.pop("has_embed"), d.pop("has_lm_head")
        eagle: dict[str, Any] = {"use_aux_hidden_state": True, "fc_norm": self.fc_norm,
                                 "norm_output": self.norm_output, "has_embed": has_embed}
        if not has_lm_head:
            eagle["has_lm_head"] = False
        if aux is not None:
            eagle["eagle_aux_hidden_state_layer_ids"] = list(aux)
        d.update(architectures=[ARCHITECTURE], model_type="llama", num_hidden_layers=1, hidden_act="silu",
                 tie_word_embeddings=False, eagle_config=eagle)
        return d


def _flag(d: dict[str, Any], eagle: dict[str, Any], key: str) -> bool:
    top, nested = d.get(key), eagle.get(key)
    if top is not None and nested is not None and bool(top) != bool(nested):
        raise ValueError(f"Eagle3 config.json sets {key}={top} at the top level but eagle_config.{key}="
                         f"{nested}; make them agree")
    return bool(top if top is not None else nested)


def _aux_ids(d: dict[str, Any], eagle: dict[str, Any]) -> list[int] | None:
    """eagle_config.eagle_aux_hidden_state_layer_ids or the top-level key (vLLM reads the top level,
    sglang the nested one); both present must agree, or one of the two servers would tap other layers."""
    key = "eagle_aux_hidden_state_layer_ids"
    nested, top = eagle.get(key), d.get(key)
    if nested is not None and top is not None and list(nested) != list(top):
        raise ValueError(f"Eagle3 config.json sets {key}={list(top)} at the top level but eagle_config.{key}="
                         f"{list(nested)}; make them agree")
    return nested if nested is not None else top


def _reject_unsupported(d: dict[str, Any]) -> None:
    """Config values whose semantics the head does not implement fail here, with the key named."""
    scaling = d.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in (None, "default"):
            raise ValueError(f"Eagle3 config rope_scaling.rope_type={kind!r} is not implemented; m3eagle's "
                             "draft head uses plain RoPE ('default'). Remove rope_scaling or retrain.")
    rope = d.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"Eagle3 config rope_parameters.rope_type={kind!r} is not implemented; only "
                         "'default'")
    # The head rotates every channel of every head (EAGLE / SpecForge / TorchSpec train it so). A partial
    # rotary width would be honoured by some servers and not by the trainers: refuse it rather than guess.
    for where, src in (("", d), ("rope_parameters.", rope), ("rope_scaling.", scaling or {})):
        factor = src.get("partial_rotary_factor")
        if factor is not None and float(factor) != 1.0:
            raise ValueError(f"Eagle3 config {where}partial_rotary_factor={factor} is not implemented; the "
                             "draft head applies RoPE to the whole head_dim")
    if float(d.get("logit_scale", 1.0)) != 1.0:
        raise ValueError(f"Eagle3 config logit_scale={d['logit_scale']} is not implemented; the draft logits "
                         "are lm_head(h) unscaled")
    if d.get("use_sliding_window"):
        raise ValueError("Eagle3 config use_sliding_window=true is not implemented; the draft layer attends "
                         "to every earlier token")
    n = d.get("num_hidden_layers", 1)
    if n != 1:
        raise ValueError(f"Eagle3 config num_hidden_layers={n}: m3eagle's {ARCHITECTURE} has exactly one "
                         "decoder layer (midlayer)")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"Eagle3 config hidden_act={act!r} is not implemented; the head's MLP is SiLU")
    for key in ("attention_bias", "qkv_bias", "mlp_bias", "norm_before_fc"):
        if d.get(key):
            raise ValueError(f"Eagle3 config {key}=true is not implemented (no such weights in the "
                             f"{ARCHITECTURE} layout m3eagle loads)")
    if d.get("norm_before_residual"):
        raise ValueError("Eagle3 config norm_before_residual=true is not implemented: m3eagle's residual "
                         "stream is the hidden input before hidden_norm (the EAGLE-3 reference)")
    eagle = d.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state", True) is False:
        raise ValueError("eagle_config.use_aux_hidden_state=false is an EAGLE-1/2 head; m3eagle loads "
                         "Eagle3 heads (fc over the concatenated aux hidden states)")


# ------------------------------------------------------------------------------------------------
# Modules
# ------------------------------------------------------------------------------------------------


class Eagle3Attention(nn.Module):
    """Dense GQA attention whose projections read the 2H-wide concat(embed part, hidden part)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.scale = d ** -0.5
        self.proj = PackedLinears([self.q_proj, self.k_proj, self.v_proj])  # one GEMM once packed

    def qkv(self, x: torch.Tensor, positions: torch.Tensor,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, 2H], positions [T] -> q [T, Hq, D], k/v [T, Hkv, D], RoPE (NeoX, full head) applied."""
        t, c = x.shape[0], self.cfg
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype)
        q = apply_rope(self.q_proj(x).view(t, c.num_attention_heads, c.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(t, c.num_key_value_heads, c.head_dim), cos, sin)
        v = self.v_proj(x).view(t, c.num_key_value_heads, c.head_dim)
        return q, k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                cache: LayerCache, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Paged path: x [T, 2H] -> [T, H]. Writes this step's K/V at meta.slot_mapping first. Same math as
        `qkv` + the cache writes, as one fused op of the engine's (`meta.ops.fused`). With `residual` [T, H]
        returns residual + the output (the add in o_proj's launch: `fused.linear_add`)."""
        t, c = x.shape[0], self.cfg
        ops = meta.ops or REFERENCE
        pq, pk, pv = self.proj(x, ops.fused)
        # No q/k norm in a Llama head; the RoPE tables (full head) are this layer's alone, so they are
        # computed in the same launch where the backend can.
        q = ops.fused.rope_qkv_store(
            pq.view(t, c.num_attention_heads, c.head_dim), pk.view(t, c.num_key_value_heads, c.head_dim),
            pv.view(t, c.num_key_value_heads, c.head_dim), positions, c.head_dim, c.rope_theta,
            cache.k, cache.v, meta.slot_mapping)
        o = ops.attention.attention(q, cache.k, cache.v, meta, self.scale)  # [T, Hq, D]
        if residual is not None:
            return ops.fused.linear_add(o.reshape(t, -1), self.o_proj.weight, residual)
        return linear(o.reshape(t, -1), self.o_proj.weight, ops.fused)

    def forward_seq(self, x: torch.Tensor, cache_kv: list[tuple[torch.Tensor, torch.Tensor]] | None,
                    ) -> torch.Tensor:
        """Contiguous path: x [B, S, 2H] -> [B, S, H]. See Eagle3Head.forward_seq for `cache_kv`."""
        b, s, c = x.shape[0], x.shape[1], self.cfg
        step = len(cache_kv) if cache_kv is not None else 0
        idx = torch.arange(s, device=x.device)
        q, k, v = self.qkv(x.reshape(b * s, -1), (idx + step).repeat(b))
        q = q.view(b, s, c.num_attention_heads, c.head_dim)
        k = k.view(b, s, c.num_key_value_heads, c.head_dim)
        v = v.view(b, s, c.num_key_value_heads, c.head_dim)
        if step == 0:
            o = reference.attend(q, k, v, idx.expand(b, s), self.scale)  # [B, S, Hq, D]
        else:
            o = _ttt_attend(q, cache_kv[0], cache_kv[1:] + [(k, v)], self.scale)
        if cache_kv is not None:
            cache_kv.append((k, v))
        return self.o_proj(o.reshape(b, s, -1))


def _ttt_attend(q: torch.Tensor, kv0: tuple[torch.Tensor, torch.Tensor],
                diag: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
    """Attention of TTT unroll step s = len(diag) >= 1 (SpecForge / EAGLE-3 training-time test).

    Index i of every step's row stands for one drafting chain whose accepted prefix ends at token i:
    step t's query at index i sits at position i + t. So the query of step s at index i sees

        step-0 keys at indices 0..i        (positions 0..i: the accepted prefix, token-causal)
        step-t keys at index i, t = 1..s   (positions i+1..i+s: its own earlier drafts, and itself)

    which is exactly what the paged draft loop attends to at inference (step-0 K/V of the accepted
    prefix, then the chain's own draft K/V). q [B, S, Hq, D], kv0 / diag[t] k,v [B, S, Hkv, D]
    -> [B, S, Hq, D]. Computed in fp32, O(S^2 + s*S) -- only the diagonals of steps >= 1 are formed."""
    b, s, hq, _ = q.shape
    rep = hq // kv0[0].shape[2]  # GQA: query head h reads KV head h // rep, as SDPA's enable_gqa

    def expand(t: torch.Tensor) -> torch.Tensor:
        return t.float().repeat_interleave(rep, dim=2) if rep > 1 else t.float()

    qf = q.float()
    scores0 = torch.einsum("bqhd,bkhd->bhqk", qf, expand(kv0[0])) * scale  # [B, Hq, S, S]
    idx = torch.arange(s, device=q.device)
    scores0 = scores0.masked_fill(idx[None, :] > idx[:, None], float("-inf"))
    diag_scores = [torch.einsum("bqhd,bqhd->bhq", qf, expand(k))[..., None] * scale for k, _ in diag]
    p = torch.softmax(torch.cat([scores0] + diag_scores, dim=-1), dim=-1)  # [B, Hq, S, S + steps]
    out = torch.einsum("bhqk,bkhd->bqhd", p[..., :s], expand(kv0[1]))
    for t, (_, v) in enumerate(diag):
        out = out + p[..., s + t].transpose(1, 2)[..., None] * expand(v)  # [B, S, Hq, 1] * [B, S, Hq, D]
    return out.to(q.dtype)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = LlamaRMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(h, cfg.rms_norm_eps)
        self.mlp = SiluMLP(h, cfg.intermediate_size)

    def attn_input(self, emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        # Order matters: the first H input columns of q/k/v_proj read the embedding, the last H the hidden.
        return torch.cat((self.input_layernorm(emb), self.hidden_norm(h)), dim=-1)

    def forward(self, emb: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                cache: LayerCache, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Paged path: (residual [T, H], mlp output [T, H]) -- the layer's output is their sum, which the
        head's final norm adds in (fused). The residual stream starts from the hidden input, not from the
        embedding (EAGLE-3 reference). emb [T, H], or with `ids` [T] the embedding table [V, H] whose rows
        ids are the embeddings (the lookup rides in the norms' launch)."""
        f = (meta.ops or REFERENCE).fused
        n1, n2, n3 = self.input_layernorm, self.hidden_norm, self.post_attention_layernorm
        width = emb.shape[-1]
        # attn_input without the cat: the two norms write the halves of the [T, 2H] projection input.
        x = torch.empty(h.shape[0], 2 * width, dtype=self.self_attn.q_proj.weight.dtype, device=h.device)
        if n1.eps == n2.eps:
            f.rms_norm_cat((emb, h), (n1.weight, n2.weight), n1.eps, x, gemma=False, ids=ids)
        else:
            emb = torch.nn.functional.embedding(ids, emb) if ids is not None else emb
            f.rms_norm(emb, n1.weight, n1.eps, gemma=False, out=x[:, :width])
            f.rms_norm(h, n2.weight, n2.eps, gemma=False, out=x[:, width:])
        attn, mlp = self.self_attn, self.mlp
        if mlp.gate_up.is_packed() and f.folds(x.shape[0], attn.o_proj.weight) and f.folds(x.shape[0], mlp.gate_up.weight):
            # The residual add in o_proj's epilogue, the post-attention norm in gate_up's prologue: one launch
            # fewer than o_proj, add_rms_norm, gate_up -- the one such fold that paid.
            h = attn(x, positions, meta, cache, residual=h)
            a = f.norm_linear(h, n3.weight, n3.eps, mlp.gate_up.weight, gemma=False, act="silu")  # [T, I]
            return h, linear(a, mlp.down_proj.weight, f)
        hn, h = f.add_rms_norm(self.self_attn(x, positions, meta, cache), h, n3.weight, n3.eps, gemma=False)
        return h, self.mlp(hn, f)

    def forward_seq(self, emb: torch.Tensor, h: torch.Tensor,
                    cache_kv: list[tuple[torch.Tensor, torch.Tensor]] | None) -> torch.Tensor:
        h = h + self.self_attn.forward_seq(self.attn_input(emb, h), cache_kv)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """The Eagle3 draft head. See the module docstring for the math and the parameter names."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        # Without its own table the head borrows the target's (set_embedding); allocating a [V, H] table
        # here would cost as much as the rest of the head for a 200k vocabulary.
        self.register_module("embed_tokens", nn.Embedding(cfg.vocab_size, h) if cfg.has_embed else None)
        self.fc = nn.Linear(cfg.aux_hidden_size, h, bias=False)
        self.fc_norm = (nn.ModuleList([LlamaRMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps)
                                       for _ in range(cfg.num_aux)]) if cfg.fc_norm else None)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = LlamaRMSNorm(h, cfg.rms_norm_eps)
        # Without its own lm_head (draft vocabulary == the target's) the head borrows the target's
        # (set_lm_head), as it borrows the embedding.
        self.register_module("lm_head", nn.Linear(h, cfg.draft_vocab_size, bias=False) if cfg.has_lm_head else None)
        # Identity mapping when the draft vocabulary is the full one; otherwise set_vocab_mapping fills it.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.full((cfg.vocab_size,), cfg.draft_vocab_size == cfg.vocab_size,
                                               dtype=torch.bool))

    # ---- weights ---------------------------------------------------------------------------------
    def set_embedding(self, weight: torch.Tensor) -> None:
        """Share a token-embedding table (normally the target's `embed_tokens.weight`, [V, H])."""
        want = (self.cfg.vocab_size, self.cfg.hidden_size)
        if tuple(weight.shape) != want:
            raise ValueError(f"set_embedding: table has shape {tuple(weight.shape)}, the Eagle3 head needs "
                             f"{want} (vocab_size, hidden_size); a head whose hidden_size differs from the "
                             "target's must ship its own embed_tokens.weight")
        # _weight wraps the given storage without allocating a new table; frozen unless the caller's
        # table is itself trainable.
        self.embed_tokens = nn.Embedding(*want, _weight=weight, _freeze=not weight.requires_grad)

    def set_lm_head(self, lm_head: torch.Tensor | nn.Module) -> None:
        """Share the target's lm_head (a head saved without `lm_head.weight`; its draft vocabulary is the
        target's, d2t all zero). A [V, H] weight, or the target's `lm_head` module itself -- a vocab-parallel
        one (tensor parallel) computes its rows' logits and gathers them, see `compute_logits`."""
        c = self.cfg
        if c.draft_vocab_size != c.vocab_size or bool(self.d2t.any()):
            raise ValueError(f"set_lm_head: the target's lm_head scores the full vocabulary ({c.vocab_size}); this "
                             f"head drafts over draft_vocab_size={c.draft_vocab_size} tokens (d2t) and needs its "
                             "own lm_head.weight")
        if isinstance(lm_head, nn.Module):
            tp = getattr(lm_head, "tp", None)
            rows = getattr(lm_head, "vocab", None) if tp is not None and tp.size > 1 else lm_head.weight.shape[0]
            if (rows, lm_head.weight.shape[1]) != (c.vocab_size, c.hidden_size):
                raise ValueError(f"set_lm_head: lm_head maps {lm_head.weight.shape[1]} -> {rows}, the Eagle3 head "
                                 f"needs hidden_size={c.hidden_size} -> vocab_size={c.vocab_size}")
            self.lm_head = lm_head
            return
        want = (c.vocab_size, c.hidden_size)
        if tuple(lm_head.shape) != want:
            raise ValueError(f"set_lm_head: weight has shape {tuple(lm_head.shape)}, the Eagle3 head needs {want} "
                             "(vocab_size, hidden_size); a head whose hidden_size differs from the target's must "
                             "ship its own lm_head.weight")
        layer = nn.Linear(c.hidden_size, c.vocab_size, bias=False, device="meta")
        layer.weight = nn.Parameter(lm_head, requires_grad=lm_head.requires_grad)  # the same storage, no copy
        self.lm_head = layer

    def _lm_head(self) -> nn.Module:
        if self.lm_head is None:
            raise RuntimeError("this Eagle3 head has no lm_head (checkpoint without lm_head.weight): call "
                               "head.set_lm_head(target.lm_head) after loading (or "
                               "m3eagle.loader.eagle3.share_target_weights(head, target))")
        return self.lm_head

    def set_vocab_mapping(self, draft_to_target: torch.Tensor) -> None:
        """Define the draft vocabulary: draft id i means target id draft_to_target[i] ([Vd] int64,
        distinct ids in [0, V)). Fills d2t (offsets) and t2d."""
        c = self.cfg
        if draft_to_target.shape != (c.draft_vocab_size,):
            raise ValueError(f"set_vocab_mapping: got {tuple(draft_to_target.shape)} ids, "
                             f"draft_vocab_size is {c.draft_vocab_size}")
        ids = draft_to_target.to(self.d2t.device, torch.int64)
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(c.draft_vocab_size, device=ids.device))
            self.t2d.zero_()
            self.t2d[ids] = True

    def new_cache(self, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> LayerCache:
        """The draft layer's own K/V pool, indexed by the same slots as the target's pools."""
        c = self.cfg
        shape = (num_slots, c.num_key_value_heads, c.head_dim)
        return LayerCache(torch.zeros(shape, dtype=dtype, device=device),
                          torch.zeros(shape, dtype=dtype, device=device))

    # ---- forward ---------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            raise RuntimeError("this Eagle3 head has no embed_tokens (checkpoint without one): call "
                               "head.set_embedding(target.embed_tokens.weight) after loading")
        return self.embed_tokens(input_ids)

    def _lookup(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(table, ids) when the embedding is a plain lookup of one whole table, which the paged layer folds
        into its norms' launch; else (embeddings, None) -- a vocab-parallel table (tensor parallel) needs
        its all-reduce."""
        e = self.embed_tokens
        tp = getattr(e, "tp", None)
        if isinstance(e, nn.Embedding) and e.max_norm is None and (tp is None or tp.size == 1):
            return e.weight, input_ids
        return self.embed(input_ids), None

    def project_aux(self, aux: torch.Tensor, fused: Any = None) -> torch.Tensor:
        """aux [..., n_aux * Ht] (the target's captured residual streams, concatenated) -> [..., H].
        `fused` (the engine's fused ops; the paged path, aux [T, n_aux * Ht]) norms each chunk in place of
        the split + cat; None = reference."""
        aux = aux.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            chunks = aux.split(self.cfg.target_hidden_size, dim=-1)
            if fused is None:
                aux = torch.cat([norm(x) for norm, x in zip(self.fc_norm, chunks)], dim=-1)
            else:  # one launch where the fused ops can (their eps agree, as a config gives them)
                out = torch.empty_like(aux)
                if len({n.eps for n in self.fc_norm}) == 1:
                    fused.rms_norm_cat(chunks, [n.weight for n in self.fc_norm], self.fc_norm[0].eps, out, gemma=False)
                else:
                    for norm, x, o in zip(self.fc_norm, chunks, out.split(self.cfg.target_hidden_size, dim=-1)):
                        fused.rms_norm(x, norm.weight, norm.eps, gemma=False, out=o)
                aux = out
            return linear(aux, self.fc.weight, fused)
        return self.fc(aux)

    def _outputs(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h_out = self.norm(h)
        return h_out, (h_out if self.cfg.norm_output else h)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttnMetadata, cache: LayerCache, from_aux: bool, rows: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step on the paged cache.

        input_ids [T], positions [T], hidden [T, n_aux * Ht] when from_aux (step 0: the target's aux
        states) else [T, H] (the previous step's h_next). Writes K/V at meta.slot_mapping into `cache`.
        Returns (h_out [T, H] for compute_logits, h_next [T, H] for the next draft step); with `rows` [R]
        only those tokens' outputs ([R, H] each: every token's K/V is still written)."""
        f = (meta.ops or REFERENCE).fused
        h = self.project_aux(hidden, f) if from_aux else hidden.to(self.fc.weight.dtype)
        emb, ids = self._lookup(input_ids)  # the table and the ids where the lookup rides in the norms' launch
        h, mlp_out = self.midlayer(emb, h, positions, meta, cache, ids)
        # _outputs, fused with the residual add (and the row gather, which rides in the same launch)
        h_out, h = f.add_rms_norm(mlp_out, h, self.norm.weight, self.norm.eps, gemma=False, rows=rows)
        return h_out, (h_out if self.cfg.norm_output else h)

    def forward_seq(self, input_ids: torch.Tensor, hidden: torch.Tensor, from_aux: bool,
                    cache_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous training / oracle path, differentiable: input_ids [B, S], hidden [B, S, Hin] ->
        (h_out, h_next) [B, S, H]. Row b's keys are its own tokens (token-causal, positions 0..S-1).

        Training-time test: pass the same list as `cache_kv` to every unroll step (start with `[]`);
        each call appends its layer K/V ([B, S, Hkv, D] pairs, still in the autograd graph), as
        SpecForge's `cache_hidden`. Unroll step s = len(cache_kv) before the call; index i of that step
        is the chain's s-th draft after the accepted prefix ending at token i, so it runs at position
        i + s and attends to step-0 keys 0..i plus the step-1..s keys at index i (see `_ttt_attend`).
        The caller shifts inputs per step as SpecForge does: step s reads input_ids shifted left by s
        and hidden = step s-1's h_next (from_aux=False). Step 0 with cache_kv=[] equals cache_kv=None."""
        h = self.project_aux(hidden) if from_aux else hidden.to(self.fc.weight.dtype)
        h = self.midlayer.forward_seq(self.embed(input_ids), h, cache_kv)
        return self._outputs(h)

    # ---- vocabulary ------------------------------------------------------------------------------
    def compute_logits(self, h_out: torch.Tensor, fused: Any = None, fp32: bool = True) -> torch.Tensor:
        """h_out [N, H] -> draft logits [N, Vd] in fp32 (fp32=False: the weights' dtype, for an argmax that
        needs no copy). `fused`: the engine's fused ops (their decode GEMV)."""
        lm = self._lm_head()
        tp = getattr(lm, "tp", None)
        if tp is not None and tp.size > 1:  # the target's vocab-parallel lm_head: its rows, all-gathered
            logits = lm(h_out, fused)
        else:
            logits = linear(h_out, lm.weight, fused)
        return logits.float() if fp32 else logits

    def greedy_ids(self, h_out: torch.Tensor, fused: Any, out: torch.Tensor | None = None,
                   scatter: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
        """h_out [N, H] -> [N] target ids of the draft logits' argmax (the logits in the weights' dtype, as
        compute_logits(fp32=False)), also written to `out` and `scatter` (FusedOps.argmax's). One launch where
        the fused ops pick the argmax in the lm_head GEMV (`FusedOps.linear_argmax`)."""
        lm = self._lm_head()
        tp = getattr(lm, "tp", None)
        if tp is not None and tp.size > 1:  # a shared vocab-parallel lm_head gathers its logits first
            return fused.argmax(self.compute_logits(h_out, fused, fp32=False), self.d2t, out, scatter)
        return fused.linear_argmax(h_out, lm.weight, self.d2t, out, scatter)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft token ids (any shape) -> target token ids."""
        return ids + self.d2t[ids]

    def draft_probs_to_target(self, probs: torch.Tensor) -> torch.Tensor:
        """probs [N, Vd] over the draft vocabulary -> [N, V] over the target's, zero off the draft ids
        (the q of rejection sampling: a target-only token has draft probability 0)."""
        target_ids = torch.arange(self.cfg.draft_vocab_size, device=probs.device) + self.d2t
        out = probs.new_zeros(probs.shape[0], self.cfg.vocab_size)
        return out.index_copy_(1, target_ids, probs)

