"""Byte-level BPE tokenizer (trained with the `tokenizers` library) and corpus tokenization.

Pre-tokenization splits digits one by one before the GPT-2 byte-level split, so every number is spelled
digit by digit: the arithmetic problems stay learnable by a tiny model and their answers parse back
exactly. `<|endoftext|>` (id 0) ends every document and is the model's EOS.

Output directory layout (the training stages read it, and it is what travels to a GPU machine):

    tokenizer.json          the tokenizer (shipped next to the target model)
    train.bin / val.bin     uint16 token ids, documents in a seeded shuffled order, EOS after each
    tokens.json             counts, vocab size, which corpus it came from
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from m3eagle.training.corpus import read_jsonl

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS]


@dataclass(frozen=True)
class TokenizerConfig:
    vocab_size: int = 8192
    train_sample_bytes: int = 24_000_000  # BPE merges are learnt on a sample; all of it is encoded
    val_fraction: float = 0.005
    seed: int = 0


def _new_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterator[str], vocab_size: int):
    from tokenizers import pre_tokenizers, trainers

    if vocab_size > 65535:
        raise ValueError(f"vocab_size={vocab_size}: token arrays are uint16, keep it below 65536")
    tok = _new_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path):
    """tokenizer.json, or a directory holding one."""
    from tokenizers import Tokenizer

    p = Path(path)
    return Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))


def write_hf_tokenizer_config(out_dir: str | Path) -> None:
    """tokenizer_config.json so transformers' AutoTokenizer opens the directory too."""
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": None,
            "pad_token": EOS, "unk_token": None, "model_max_length": 4096,
            "clean_up_tokenization_spaces": False}
    (Path(out_dir) / "tokenizer_config.json").write_text(json.dumps(conf, indent=2))


def _documents(corpus_dir: Path, seed: int) -> list[str]:
    docs = [d["text"] for d in read_jsonl(corpus_dir / "code.jsonl")]
    docs += [d["text"] for d in read_jsonl(corpus_dir / "arithmetic.jsonl")]
    random.Random(seed).shuffle(docs)
    return docs


def _encode(tok, docs: list[str], desc: str) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    parts: list[np.ndarray] = []
    bar = tqdm(total=len(docs), desc=desc, unit="doc", mininterval=2.0, dynamic_ncols=True)
    for i in range(0, len(docs), 512):
        for enc in tok.encode_batch(docs[i:i + 512], add_special_tokens=False):
            parts.append(np.asarray(enc.ids + [eos], dtype=np.uint16))
        bar.update(min(512, len(docs) - i))
    bar.close()
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def build(corpus_dir: str | Path, out_dir: str | Path, cfg: TokenizerConfig = TokenizerConfig()) -> dict:
    """Train the tokenizer on a sample of the corpus, then encode all of it. Resumable: a finished
    tokenizer.json is reused, finished token arrays are kept."""
    corpus_dir, out = Path(corpus_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "tokens.json"
    if meta_path.is_file() and json.loads(meta_path.read_text()).get("config") == asdict(cfg):
        print(f"tokenizer: {out} is complete, reusing it")
        return json.loads(meta_path.read_text())
    docs = _documents(corpus_dir, cfg.seed)
    if (out / "tokenizer.json").is_file():
        tok = load_tokenizer(out)
    else:
        def sample() -> Iterator[str]:
            total = 0
            for d in docs:
                if total > cfg.train_sample_bytes:
                    return
                total += len(d)
                yield d
        tok = train_tokenizer(sample(), cfg.vocab_size)
        tok.save(str(out / "tokenizer.json"))
    write_hf_tokenizer_config(out)
    n_val = max(1, int(len(docs) * cfg.val_fraction))
    val, train = docs[:n_val], docs[n_val:]
    arrays = {"val": _encode(tok, val, "tokenize: val"), "train": _encode(tok, train, "tokenize: train")}
    for name, arr in arrays.items():
        arr.tofile(out / f"{name}.bin.tmp")
        (out / f"{name}.bin.tmp").replace(out / f"{name}.bin")
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    meta = {"config": asdict(cfg), "vocab_size": tok.get_vocab_size(), "eos_id": tok.token_to_id(EOS),
            "train_tokens": int(arrays["train"].size), "val_tokens": int(arrays["val"].size),
            "bytes_per_token": n_bytes / max(1, sum(a.size for a in arrays.values())),
            "corpus": str(corpus_dir)}
    meta_path.write_text(json.dumps(meta, indent=2))
    return meta


def load_tokens(data_dir: str | Path, split: str) -> np.ndarray:
    """uint16 token array of a split, memory-mapped."""
    return np.memmap(Path(data_dir) / f"{split}.bin", dtype=np.uint16, mode="r")
