"""The embedded model: the trained MiniMax-M3-architecture target and its Eagle3 head that ship inside the
package, so everything runs with no download."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "default"


def default_model_paths() -> tuple[Path, Path | None]:
    """(target directory, Eagle3 head directory or None) of the embedded model."""
    target, draft = ASSETS / "target", ASSETS / "draft"
    if not (target / "config.json").is_file():
        raise FileNotFoundError(f"no embedded model at {target}; pass model=DIR")
    return target, (draft if (draft / "config.json").is_file() else None)
