"""The offline API, shaped like vLLM's: LLM(model=...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..attention import backend
from ..engine.llm_engine import EngineConfig, LLMEngine, RequestError
from ..engine.request import RequestOutput
from ..loader.checkpoint import load_target
from ..sampling.params import SamplingParams

log = logging.getLogger("m3eagle")

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "default"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def default_model_paths() -> tuple[Path, Path | None]:
    target, draft = ASSETS / "target", ASSETS / "draft"
    if not (target / "config.json").is_file():
        raise FileNotFoundError(f"no embedded model at {target}; pass model=DIR")
    return target, (draft if (draft / "config.json").is_file() else None)


def _resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


class LLM:
    """Offline engine.

    model: a checkpoint directory (config.json + safetensors [+ tokenizer.json]); None uses the embedded
    model and its Eagle3 head. draft: an Eagle3 head directory; num_draft_tokens: K (1..8; 0 = off).
    overlap: None = on for CUDA, off for CPU. attention_backend: 'auto' | 'reference' | 'triton'."""

    def __init__(self, model: str | Path | None = None, draft: str | Path | None = None,
                 num_draft_tokens: int | None = None, dtype: str | torch.dtype = "auto",
                 device: str | None = None, page_size: int = 16, max_num_tokens: int = 512,
                 max_model_len: int | None = None, max_num_seqs: int = 64, num_pages: int = 0,
                 overlap: bool | None = None, attention_backend: str = "auto"):
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device; use device='cpu'")
        self.device = dev
        self.dtype = _resolve_dtype(dtype, dev)
        if model is None:
            model, default_draft = default_model_paths()
            if draft is None and num_draft_tokens != 0:
                draft = default_draft
        if num_draft_tokens is None:
            num_draft_tokens = 3 if draft is not None else 0
        if not isinstance(num_draft_tokens, int) or not 0 <= num_draft_tokens <= 8:
            raise ValueError(f"num_draft_tokens={num_draft_tokens!r} must be an int in 0..8 (0 disables "
                             "speculation)")
        if num_draft_tokens > 0 and draft is None:
            raise ValueError(f"num_draft_tokens={num_draft_tokens} needs a draft head: pass draft=DIR "
                             "(an Eagle3 checkpoint) or num_draft_tokens=0")
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1")
        self.model_path = Path(model)
        if attention_backend == "auto":
            attention_backend = "triton" if dev.type == "cuda" else "reference"
        backend.set_backend(attention_backend)
        self.target = load_target(self.model_path, self.dtype, dev)
        self.draft = None
        if draft is not None and num_draft_tokens > 0:
            from ..loader.eagle3 import load_eagle3

            self.draft = load_eagle3(draft, self.target.cfg, self.dtype, dev)
            if not self.draft.cfg.has_embed:
                self.draft.set_embedding(self.target.embed_tokens.weight)
        self.tokenizer = _load_tokenizer(self.model_path)
        mml = max_model_len if max_model_len is not None else min(self.target.cfg.max_position_embeddings, 2048)
        if mml > self.target.cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={mml} exceeds the model's max_position_embeddings="
                             f"{self.target.cfg.max_position_embeddings}")
        self.config = EngineConfig(page_size=page_size, num_pages=num_pages, max_num_tokens=max_num_tokens,
                                   max_num_seqs=max_num_seqs, max_model_len=mml,
                                   num_draft_tokens=num_draft_tokens if self.draft is not None else 0,
                                   overlap=(dev.type == "cuda") if overlap is None else overlap)
        self.engine = LLMEngine(self.target, self.draft, self.tokenizer, self.config, self.dtype, dev)
        self._all_outputs: list[RequestOutput] = []

    # ---- generation -----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{self.model_path} has no tokenizer.json; pass token-id lists instead of text")
        return self.tokenizer.encode(text)

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt
        params = sampling_params if sampling_params is not None else SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        encoded = []
        for i, p in enumerate(prompts):  # validate everything before anything runs
            ids = self.encode(p) if isinstance(p, str) else list(p)
            try:
                self.engine.validate(ids, plist[i])
            except RequestError as e:
                raise RequestError(f"prompt {i}: {e}") from None
            encoded.append((ids, p if isinstance(p, str) else None))
        reqs = [self.engine.add_request(ids, plist[i], text) for i, (ids, text) in enumerate(encoded)]
        bar = _Progress(len(reqs)) if use_tqdm else None
        while self.engine.has_work():
            done = self.engine.step()
            if bar:
                bar.update(len(done))
        if bar:
            bar.close()
        outs = [r.to_output() for r in reqs]
        self._all_outputs += outs
        return outs

    # ---- metrics ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Speculative metrics over every request generated since the last reset_stats()."""
        return aggregate_stats(self._all_outputs, self.config.num_draft_tokens)

    def reset_stats(self) -> None:
        self._all_outputs = []


def aggregate_stats(outputs: list[RequestOutput], k: int) -> dict[str, Any]:
    drafted = sum(o.num_drafted for o in outputs)
    accepted = sum(o.num_accepted for o in outputs)
    steps = sum(o.num_verify_steps for o in outputs)
    per_pos = []
    for j in range(k):
        d = sum(o.drafted_per_position[j] for o in outputs if o.drafted_per_position)
        a = sum(o.accepted_per_position[j] for o in outputs if o.accepted_per_position)
        per_pos.append(a / d if d else 0.0)
    return {"num_requests": len(outputs), "num_generated_tokens": sum(len(o.token_ids) for o in outputs),
            "num_draft_tokens": k, "num_drafted": drafted, "num_accepted": accepted, "num_verify_steps": steps,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_acceptance_length": 1 + accepted / steps if steps else 1.0,
            "per_position_rates": per_pos}


def _load_tokenizer(path: Path):
    f = path / "tokenizer.json"
    if not f.is_file():
        return None
    from tokenizers import Tokenizer

    return _Tok(Tokenizer.from_file(str(f)))


class _Tok:
    """Thin wrapper: encode(text) -> ids, decode(ids) -> text."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


class _Progress:
    """A minimal progress bar on stderr (no extra dependency)."""

    def __init__(self, total: int):
        self.total, self.n, self.t0 = total, 0, time.perf_counter()

    def update(self, k: int) -> None:
        self.n += k
        if k:
            w = 30
            f = int(w * self.n / max(self.total, 1))
            sys.stderr.write(f"\r[{'#' * f}{'.' * (w - f)}] {self.n}/{self.total} "
                             f"{time.perf_counter() - self.t0:.1f}s")
            sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
