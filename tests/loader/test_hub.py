"""Hub model ids: `LLM(model="org/name")` resolves through huggingface_hub's cache. The tests populate a cache
in the layout huggingface_hub writes (refs/main -> snapshots/<commit>/...) and run with HF_HUB_OFFLINE=1, so
nothing touches the network; a repository missing from the cache is named with the fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from m3eagle.loader.assets import default_model_paths
from m3eagle.loader.hub import resolve_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def populate(cache: Path, repo: str, src: Path) -> Path:
    """Copy src's files into `cache` as huggingface_hub stores a snapshot of `repo` at COMMIT."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / COMMIT
    shutil.copytree(src, snap)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    return snap


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))  # read by snapshot_download at call time
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    return cache


def test_a_repository_id_resolves_to_its_cached_snapshot(hub_cache):
    target, _ = default_model_paths()
    snap = populate(hub_cache, "MiniMaxAI/MiniMax-M3-Tiny", target)
    assert resolve_checkpoint("MiniMaxAI/MiniMax-M3-Tiny") == snap
    assert resolve_checkpoint(target) == target  # a local directory is used as it is


def test_the_llm_loads_a_hub_id_from_the_cache(hub_cache, make_llm):
    target, draft = default_model_paths()
    populate(hub_cache, "m3eagle/embedded-target", target)
    populate(hub_cache, "m3eagle/embedded-eagle3", draft)
    from tests.helpers.engine_utils import greedy

    hub = make_llm("m3eagle/embedded-target", draft="m3eagle/embedded-eagle3", num_draft_tokens=3)
    local = make_llm(target, draft=draft, num_draft_tokens=3)
    prompt = [hub.encode("def add(a, b):")]
    want = local.generate(prompt, greedy(8))[0].outputs[0].token_ids
    assert hub.generate(prompt, greedy(8))[0].outputs[0].token_ids == want and hub.model_path != local.model_path


def test_an_uncached_id_offline_is_named_with_the_fix(hub_cache):
    with pytest.raises(FileNotFoundError, match=r"model='nobody/not-cached' is not in the Hugging Face cache and "
                                                r"HF_HUB_OFFLINE is set: download it first \(`huggingface-cli download"):
        resolve_checkpoint("nobody/not-cached")


def test_a_missing_local_path_is_left_to_the_loader(hub_cache, tmp_path):
    """A path that is no repository id is never sent to the Hub; the loader names what is missing."""
    from m3eagle.loader.checkpoint import CheckpointError, load_config

    missing = tmp_path / "not" / "a" / "checkpoint"
    assert resolve_checkpoint(missing) == missing
    with pytest.raises(CheckpointError, match="config.json"):
        load_config(resolve_checkpoint(missing))


def test_a_file_is_not_a_checkpoint(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(ValueError, match="is a file; pass the checkpoint directory"):
        resolve_checkpoint(f)
