"""Block configurations of the fused MoE kernels, per GPU, layer shape and step-size bucket.

`tuned_configs.json` (beside this file) is the table: {device name: {shape key: {bucket T: config}}}, the
shape key being `shape_key(E, H, I, k, dtype)`. A step of T tokens uses the smallest bucket >= T (the
largest bucket past the end). Buckets cover decode / spec-verify steps (T = 1..256) and prefill chunks
(T = 512..8192). `benchmarks/moe_kernel.py --tune --write` measures candidates on the GPU and rewrites
the table; a shape or device that is not in it falls back to `heuristic_config`.

Why block_m matters most: the alignment pads every expert's token segment to a multiple of block_m, and
a block of block_m rows reads the expert's whole weight slice once. Decode steps route ~T*k/E tokens to
each chosen expert, so small block_m (16) wastes the least; prefill wants 64-128 rows to reuse weights.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

TABLE_PATH = Path(__file__).with_name("tuned_configs.json")
BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class MoEConfig:
    """One launch configuration, shared by the gate_up and down GEMMs (the alignment's block_m is theirs).

    block_n counts output columns per program: for gate_up, block_n gate columns *and* the matching
    block_n up columns (the SwiGLU epilogue needs both), so its weight tile is 2 * block_n rows."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    # 1: the sort-free decode path (`direct.py`): block_n / block_k tile its gate_up GEMV, down_block_n /
    # down_block_k its down + combine, num_stages pipelines their K loops (1: none); block_m and group_m
    # are unused.
    direct: int = 0
    # The down GEMM's own column / K tiles, on either path (0: block_n / block_k): its N is H and its K is I,
    # where gate_up's are 2I (block_n gate + block_n up columns) and H, so their best tiles can differ.
    down_block_n: int = 0
    down_block_k: int = 0
    # 1: on the sorted path, a row block holding at most block_m / 2 pairs (an expert's padded last block)
    # runs a half-height tile in both GEMMs (block_m >= 32 only): less MMA work on padding rows.
    split_tail: int = 0
    # Direct path only. down_preload 1: down loads its weights before its PDL wait when one K tile covers I
    # (direct.py). route_shared 1: the router and the shared expert's gate_up share one launch
    # (`direct.route_direct_experts`; when the layer fuses its shared expert and routes with the triton ops).
    down_preload: int = 0
    route_shared: int = 0
    # Direct path only. down_rows > 1: each down program computes that many column tiles, the next tile's
    # weights loaded while this one's sums run (`direct._direct_down_rows_kernel`; one K tile over I only).
    down_rows: int = 0
    # Direct path only. gate_rows > 1: each gate_up program computes that many column tiles of its pair, the
    # next K step's weights loaded during this one's FMAs (`direct._direct_gate_up_rows_kernel`).
    gate_rows: int = 0
    # Direct path with route_shared only, one down K tile over I. shared_down 1 / 2 / 4: the shared expert's
    # down runs in the routed gate_up launch, that many tiles per program, its weights loaded before the PDL
    # wait (they stream during the router's latency); down adds its rounded rows (`direct.shared_down_tiles`).
    shared_down: int = 0

    def down(self) -> MoEConfig:
        """The config the sorted path's down GEMM runs with (block_m, group_m, warps, stages shared)."""
        if not (self.down_block_n or self.down_block_k):
            return self
        return replace(self, block_n=self.down_block_n or self.block_n, block_k=self.down_block_k or self.block_k,
                       down_block_n=0, down_block_k=0)

    @classmethod
    def from_dict(cls, d: dict) -> MoEConfig:
        return cls(**{k: int(v) for k, v in d.items()})

    def to_dict(self) -> dict:
        """Fields at their defaults are left out, so the table's sorted-path rows stay as they were."""
        d = asdict(self)
        for f in ("direct", "down_block_n", "down_block_k", "split_tail", "down_preload", "route_shared",
                  "down_rows", "gate_rows", "shared_down"):
            if d[f] == 0:
                del d[f]
        return d


def shape_key(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype) -> str:
    return f"E={num_experts},H={hidden},I={inter},k={top_k},dtype={str(dtype).removeprefix('torch.')}"


def bucket(num_tokens: int) -> int:
    return next((b for b in BUCKETS if b >= num_tokens), BUCKETS[-1])


def heuristic_config(num_tokens: int, num_experts: int, top_k: int) -> MoEConfig:
    """H200-minded defaults by tokens per expert (close to what vLLM ships for similar shapes): small row
    blocks and narrow column blocks while the step is weight-bandwidth-bound, so enough programs stream
    the few chosen experts' weights; 64-row blocks and wide tiles once it is FLOP-bound."""
    if num_tokens <= 4:  # decode / batch-1 verify: no sorting, two launches (direct.py)
        return MoEConfig(16, 16, 256, num_stages=1, direct=1, down_block_n=16, down_block_k=128)
    return _sorted_heuristic(num_tokens * top_k / max(1, num_experts))


def _sorted_heuristic(per_expert: float) -> MoEConfig:
    """The sorted path's blocks by routed pairs per expert."""
    if per_expert <= 4:
        return MoEConfig(16, 32, 128, 1, 4, 4)
    if per_expert <= 16:
        return MoEConfig(16, 64, 128, 1, 4, 3)
    if per_expert <= 64:
        return MoEConfig(32, 64, 128, 8, 4, 3)
    if per_expert <= 256:
        return MoEConfig(64, 64, 64, 8, 4, 3)
    return MoEConfig(64, 128, 64, 8, 8, 3)


def mx_config(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype) -> MoEConfig:
    """The MXFP8 sorted path's blocks (`triton_moe.mx_fused_experts`): a rule, not the table (its entries are
    measured with bf16 weights). `heuristic_config`'s sorted-path row and column blocks by tokens per expert,
    with block_k 64 (two scale groups) and 8 warps from 16 pairs per expert on: the gate and up tiles are
    dequantized in registers beside the accumulators, and ptxas (sm_90) spills the gate_up GEMM at block_k 128
    or 4 warps there (16 x 64 x 128: 1.5 KB a thread; 16 x 64 x 64 at 8 warps: none). fp16 activations take
    block_k 32: their scale applies per 32-column group after the MMA (`triton_moe._mx_dot`'s GROUP_SCALE)."""
    per_expert = num_tokens * top_k / max(1, num_experts)
    cfg = replace(_sorted_heuristic(per_expert), block_k=64)
    if per_expert > 4:
        cfg = replace(cfg, num_warps=8)
    return replace(cfg, block_k=32) if dtype == torch.float16 else cfg


@functools.cache
def load_table(path: str = str(TABLE_PATH)) -> dict[str, dict[str, dict[int, MoEConfig]]]:
    p = Path(path)
    if not p.exists():
        return {}
    raw = json.loads(p.read_text())
    return {dev: {key: {int(b): MoEConfig.from_dict(c) for b, c in per.items()} for key, per in shapes.items()}
            for dev, shapes in raw.items() if not dev.startswith("_")}


@functools.cache
def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def get_config(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
               device: torch.device) -> MoEConfig:
    """The tuned config of the nearest bucket >= num_tokens, else the heuristic. Host ints only."""
    per = load_table().get(device_name(device), {}).get(shape_key(num_experts, hidden, inter, top_k, dtype))
    if per:
        b = next((b for b in sorted(per) if b >= num_tokens), max(per))
        return per[b]
    return heuristic_config(num_tokens, num_experts, top_k)


def dump_table(raw: dict) -> str:
    """The table as JSON with one config per line (diffs stay readable). raw: {device: {key: {bucket:
    config dict}}}, plus `_`-prefixed notes."""
    lines = ["{"]
    items = list(raw.items())
    for i, (dev, shapes) in enumerate(items):
        end = "," if i < len(items) - 1 else ""
        if dev.startswith("_"):
            lines.append(f" {json.dumps(dev)}: {json.dumps(shapes)}{end}")
            continue
        lines.append(f" {json.dumps(dev)}: {{")
        for j, (key, per) in enumerate(shapes.items()):
            lines.append(f"  {json.dumps(key)}: {{")
            rows = sorted(per.items(), key=lambda kv: int(kv[0]))
            for m, (b, cfg) in enumerate(rows):
                lines.append(f"   {json.dumps(str(b))}: {json.dumps(cfg)}{',' if m < len(rows) - 1 else ''}")
            lines.append("  }" + ("," if j < len(shapes) - 1 else ""))
        lines.append(" }" + end)
    lines.append("}")
    return "\n".join(lines) + "\n"
