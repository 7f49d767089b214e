"""`m3eagle eval` extras: the --quick preset and --plot (matplotlib, an optional extra)."""

from __future__ import annotations

import argparse
import builtins

import pytest

from m3eagle.training.evaluate import QUICK, EvalConfig, plot_acceptance, require_matplotlib

RESULT = {"code": {"acceptance": {
    "K=1": {"mean_acceptance_length": 1.74, "acceptance_rate": 0.744, "per_position_rates": [0.744]},
    "K=3": {"mean_acceptance_length": 2.69, "acceptance_rate": 0.565, "per_position_rates": [0.72, 0.547, 0.427]},
}}}


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = plot_acceptance(RESULT, tmp_path / "acc.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    # simulate_acceptance's result (K=... at the top level) plots too
    assert plot_acceptance(RESULT["code"]["acceptance"], tmp_path / "sim.png").is_file()


def test_plot_without_matplotlib_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kw):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r"m3eagle\[plot\]"):
        require_matplotlib()


def test_quick_preset_is_small_and_flags_override_it():
    from m3eagle.training.cli import _override, add_training_subcommands

    full = EvalConfig()
    assert QUICK.code_prompts * QUICK.code_max_tokens * 8 <= full.code_prompts * full.code_max_tokens
    assert QUICK.ks == (1, 3) and QUICK.ppl_tokens <= full.ppl_tokens // 8
    p = argparse.ArgumentParser()
    add_training_subcommands(p.add_subparsers(dest="cmd"))
    a = p.parse_args(["eval", "--quick", "--code-prompts", "4", "--plot", "x.png"])
    assert a.quick and a.plot == "x.png"
    cfg = _override(QUICK, argparse.Namespace(**{k: v for k, v in vars(a).items() if k != "ks"}))
    assert cfg.code_prompts == 4 and cfg.code_max_tokens == QUICK.code_max_tokens
