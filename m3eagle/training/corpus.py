"""Corpus builder: third-party Python source from site-packages plus synthetic arithmetic problems.

The code part is every `.py` file under the running interpreter's site-packages, deduplicated by
content, with the Python standard library excluded entirely: the stdlib is the held-out evaluation
domain (`m3eagle eval` draws its prompts and its perplexity text from it). "Excluded" covers copies too:
a site-packages file byte-identical to a stdlib file is dropped, and so are packages that vendor or
backport stdlib modules (`VENDORED_STDLIB`).

Output directory layout (the `tokenizer` stage reads it):

    code.jsonl        {"path": relative path, "text": source}   one file per line, seeded order
    arithmetic.jsonl  {"text": problem with worked solution}
    meta.json         sizes, seeds, the interpreter it came from
"""

from __future__ import annotations

import hashlib
import json
import random
import site
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from m3eagle.training import arithmetic

# Path components of site-packages code that is a copy or backport of the stdlib. Keeping them would
# leak the held-out domain into training.
# A name in VENDORED_STDLIB matches a top-level package/module or one under a `_vendor`-style folder.
VENDORED_STDLIB = frozenset({
    "importlib_metadata", "importlib_resources", "backports", "tomli", "zipp", "typing_extensions",
    "exceptiongroup", "dataclasses", "enum34", "singledispatch", "contextlib2", "mock", "pathlib2",
    "configparser", "futures", "trollius", "asyncio", "statistics", "typing", "enum", "ipaddress",
})
ALWAYS_EXCLUDED = frozenset({"_distutils", "_distutils_hack"})
VENDOR_DIRS = frozenset({"_vendor", "vendor", "_vendored", "extern", "_extern"})
# Skip generated tables and minified data that look nothing like hand-written code.
MAX_FILE_BYTES = 400_000
MAX_LINE_CHARS = 1_000


@dataclass(frozen=True)
class CorpusConfig:
    # Built on the GPU machine from its own site-packages (several hundred MB of third-party Python), so
    # nothing large travels. 240 MB of code + 220k problems: ~100M tokens, the arithmetic kept at the
    # ~23% byte share of the first corpus (42 MB + 40k problems, which the target overfitted).
    max_code_bytes: int = 240_000_000
    arith_problems: int = 220_000
    seed: int = 0
    arith_seed: int = 0  # the evaluation set uses another seed and drops overlaps


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def site_packages_dirs() -> list[Path]:
    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    seen: list[Path] = []
    for d in dirs:
        p = Path(d).resolve()
        if p.is_dir() and p not in seen:
            seen.append(p)
    return seen


def stdlib_files() -> list[Path]:
    """Every stdlib .py file, excluding site-packages (which lives under the stdlib directory)."""
    root = stdlib_dir()
    sp = set(site_packages_dirs())
    out = []
    for p in sorted(root.rglob("*.py")):
        if any(parent in sp for parent in p.parents) or "site-packages" in p.parts:
            continue
        out.append(p)
    return out


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()


def _read_source(p: Path) -> str | None:
    try:
        if p.stat().st_size > MAX_FILE_BYTES:
            return None
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not text.strip() or any(len(line) > MAX_LINE_CHARS for line in text.splitlines()):
        return None
    return text


def is_vendored_stdlib(parts: tuple[str, ...]) -> bool:
    """True for site-packages paths that copy or backport stdlib code (see VENDORED_STDLIB)."""
    for i, part in enumerate(parts):
        name = part[:-3] if part.endswith(".py") else part
        if name in ALWAYS_EXCLUDED:
            return True
        if name in VENDORED_STDLIB and (i == 0 or parts[i - 1] in VENDOR_DIRS):
            return True
    return False


def iter_site_packages_code(excluded_digests: set[str]) -> Iterator[tuple[str, str]]:
    """(relative path, text) of third-party sources, sorted by path, deduplicated by content."""
    std = stdlib_dir()
    seen = set(excluded_digests)
    for root in site_packages_dirs():
        if root == std:  # never happens on a normal install, but guard the held-out domain anyway
            continue
        for p in sorted(root.rglob("*.py")):
            rel = p.relative_to(root)
            if is_vendored_stdlib(rel.parts):
                continue
            text = _read_source(p)
            if text is None:
                continue
            d = _digest(text)
            if d in seen:
                continue
            seen.add(d)
            yield str(rel), text


def build(out_dir: str | Path, cfg: CorpusConfig = CorpusConfig()) -> dict:
    """Write code.jsonl, arithmetic.jsonl and meta.json; returns the meta dict. Idempotent: a finished
    directory (meta.json with the same config) is left as it is."""
    out = Path(out_dir)
    meta_path = out / "meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("config") == asdict(cfg):
            print(f"corpus: {out} is complete, reusing it")
            return meta
    out.mkdir(parents=True, exist_ok=True)

    std_digests = set()
    for p in stdlib_files():
        text = _read_source(p)
        if text is not None:
            std_digests.add(_digest(text))
    files = list(tqdm(iter_site_packages_code(std_digests), desc="corpus: scan site-packages",
                          unit="file", mininterval=2.0, dynamic_ncols=True))
    random.Random(cfg.seed).shuffle(files)  # the cap keeps a random sample of packages, not a-z
    code_bytes = n_code = 0
    with open(out / "code.jsonl.tmp", "w", encoding="utf-8") as fh:
        for rel, text in files:
            size = len(text.encode("utf-8"))
            if code_bytes + size > cfg.max_code_bytes:
                continue
            fh.write(json.dumps({"path": rel, "text": text}) + "\n")
            code_bytes += size
            n_code += 1
    (out / "code.jsonl.tmp").replace(out / "code.jsonl")

    arith_bytes = 0
    with open(out / "arithmetic.jsonl.tmp", "w", encoding="utf-8") as fh:
        problems = arithmetic.generate(cfg.arith_problems, cfg.arith_seed)
        for prob in tqdm(problems, total=cfg.arith_problems, desc="corpus: arithmetic", unit="problem",
                         mininterval=2.0, dynamic_ncols=True):
            fh.write(json.dumps({"text": prob.text}) + "\n")
            arith_bytes += len(prob.text)
    (out / "arithmetic.jsonl.tmp").replace(out / "arithmetic.jsonl")

    meta = {"config": asdict(cfg), "code_files": n_code, "code_files_available": len(files),
            "code_bytes": code_bytes, "arith_problems": cfg.arith_problems, "arith_bytes": arith_bytes,
            "stdlib_files_excluded": len(std_digests), "python": sys.version.split()[0],
            "site_packages": [str(p) for p in site_packages_dirs()]}
    meta_path.write_text(json.dumps(meta, indent=2))
    return meta


def read_jsonl(path: str | Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            yield json.loads(line)
