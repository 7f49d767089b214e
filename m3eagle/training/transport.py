"""Move a training run's results through a size-limited channel (e.g. a remote GPU machine's output folder
that returns at most a few files of at most 16 MiB each).

    python -m m3eagle.training.transport pack   RUN_DIR OUT_DIR     # on the GPU machine
    python -m m3eagle.training.transport unpack OUT_DIR RUN_DIR     # back here

RUN_DIR holds target/ and draft/ (the train-target / train-draft output directories). `pack` writes the
final weights (the target's safetensors split into parts under the size limit), the configs, and one
tarball of logs and summaries; `unpack` rebuilds target/final and draft/final (without the tokenizer,
which never left this machine: copy it from the data directory).
"""

from __future__ import annotations

import shutil
import sys
import tarfile
from pathlib import Path

from safetensors.torch import load_file, save_file

LIMIT = 15 * 2**20  # bytes per returned file, with margin under 16 MiB
LOG_FILES = ("log.jsonl", "summary.json", "simulated_acceptance.json")


def split_safetensors(src: Path, out_dir: Path, prefix: str, limit: int = LIMIT) -> list[Path]:
    sd = load_file(str(src))
    parts: list[dict] = [{}]
    size = 0
    for name in sorted(sd):
        n = sd[name].numel() * sd[name].element_size()
        if parts[-1] and size + n > limit:
            parts.append({})
            size = 0
        parts[-1][name] = sd[name]
        size += n
    paths = []
    for i, part in enumerate(parts):
        p = out_dir / f"{prefix}_part{i}.safetensors"
        save_file(part, str(p))
        paths.append(p)
    return paths


def merge_safetensors(parts: list[Path], dst: Path) -> None:
    sd: dict = {}
    for p in sorted(parts):
        sd.update(load_file(str(p)))
    dst.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(dst))


def pack(run_dir: str | Path, out_dir: str | Path) -> None:
    run, out = Path(run_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stage in ("target", "draft"):
        final = run / stage / "final"
        if (final / "model.safetensors").is_file():
            split_safetensors(final / "model.safetensors", out, stage)
            shutil.copy(final / "config.json", out / f"{stage}_config.json")
    with tarfile.open(out / "logs.tgz", "w:gz") as tar:
        for stage in ("target", "draft"):
            for f in LOG_FILES:
                if (run / stage / f).is_file():
                    tar.add(run / stage / f, arcname=f"{stage}/{f}")
        for extra in sorted(run.glob("*.log")):
            tar.add(extra, arcname=extra.name)


def unpack(out_dir: str | Path, run_dir: str | Path) -> None:
    src, run = Path(out_dir), Path(run_dir)
    for stage in ("target", "draft"):
        parts = sorted(src.glob(f"{stage}_part*.safetensors"))
        if parts:
            merge_safetensors(parts, run / stage / "final" / "model.safetensors")
            shutil.copy(src / f"{stage}_config.json", run / stage / "final" / "config.json")
    if (src / "logs.tgz").is_file():
        with tarfile.open(src / "logs.tgz") as tar:
            tar.extractall(run, filter="data")


if __name__ == "__main__":
    cmd, a, b = sys.argv[1:4]
    {"pack": pack, "unpack": unpack}[cmd](a, b)
