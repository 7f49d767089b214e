"""Where a model comes from: a local checkpoint directory, or a Hugging Face Hub repository id
("MiniMaxAI/MiniMax-M3") resolved through `huggingface_hub` -- its cache first, a download when online.

Only what m3eagle reads is fetched: configs, safetensors shards and their index, the tokenizer and the chat
template (the vision tower's preprocessor files and the like are left out). `HF_HUB_OFFLINE=1` (read at each
call) resolves from the cache alone and names the missing repository otherwise; `HF_HUB_CACHE` / `HF_HOME`
choose the cache, as everywhere in the Hugging Face stack.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

# what a checkpoint directory needs: config / generation_config / tokenizer json, weights, chat template
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def is_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in ("1", "true", "yes", "on")


def resolve_checkpoint(ref: str | Path, what: str = "model", revision: str | None = None) -> Path:
    """A local path as it is (the loader names what a directory lacks); an `org/name` that is no local path
    through the Hugging Face cache (downloading the checkpoint files when online). Errors name the argument and
    the fix."""
    path = Path(ref)
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{what}={str(ref)!r} is a file; pass the checkpoint directory (config.json + "
                             "*.safetensors) or a Hub repository id")
        return path
    name = str(ref)
    if not _REPO_ID.fullmatch(name):
        return path  # a local path that does not exist: the loader's error names the missing config.json
    offline = is_offline()
    try:
        return Path(snapshot_download(repo_id=name, revision=revision, allow_patterns=CHECKPOINT_PATTERNS,
                                      local_files_only=offline))
    except LocalEntryNotFoundError:
        why = ("HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached")
        raise FileNotFoundError(f"{what}={name!r} is not in the Hugging Face cache and {why}: download it first "
                                f"(`huggingface-cli download {name}`), or pass a local directory") from None
    except GatedRepoError:
        raise PermissionError(f"{what}={name!r} is gated on the Hub: accept its terms and log in "
                              "(`huggingface-cli login` or HF_TOKEN)") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise FileNotFoundError(f"{what}={name!r} (revision {revision or 'main'}) does not exist on the Hub, or is "
                                "private: check the id, or log in (HF_TOKEN)") from None
    except HfHubHTTPError as e:
        raise FileNotFoundError(f"{what}={name!r}: the Hub answered {e}; retry, or pass a local directory") from None
