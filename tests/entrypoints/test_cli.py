"""The command line's contract: library errors are one line on stderr and exit 2,
out-of-range options name themselves, a closed stdout pipe exits quietly, --version, defaults in --help."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from m3eagle.entrypoints.cli import main

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "m3eagle" / "assets" / "default" / "target"


def _usage_error(capsys, argv: list[str]) -> str:
    """argparse refuses argv: exit 2, the message on stderr."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def _one_line_error(capsys, argv: list[str]) -> str:
    """The command fails with exit 2 and the error as one line on stderr (after any progress lines), no
    traceback."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and lines[-1].startswith("m3eagle: error: "), err
    assert sum("error" in line for line in lines) == 1, err
    return lines[-1]


# ---- --version, defaults in help -------------------------------------------------------------------


def test_version(capsys):
    from m3eagle import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"m3eagle {__version__}"


def test_help_shows_defaults(capsys):
    for cmd, shown in (("generate", "(default: 64)"), ("bench", "(default: 1,8,32)")):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        assert shown in capsys.readouterr().out


# ---- out-of-range values name their option -----------------------------------------------------------


@pytest.mark.parametrize("flag", ["--seed", "--max-tokens", "--top-k"])
def test_values_over_int64_name_the_option(capsys, flag):
    err = _usage_error(capsys, ["generate", "hi", flag, "99999999999999999999", "--device", "cpu"])
    assert f"argument {flag}" in err and "2**63 - 1" in err


@pytest.mark.parametrize("argv, flag", [
    (["generate", "hi", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "hi", "--top-p", "0"], "--top-p"),
    (["generate", "hi", "--temperature", "nan"], "--temperature"),
    (["generate", "hi", "--num-draft-tokens", "9"], "--num-draft-tokens"),
    (["bench", "--batch-sizes", "0"], "--batch-sizes"),
    (["bench", "--batch-sizes", "1,,8"], "--batch-sizes"),
    (["bench", "--num-batches", "0"], "--num-batches"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--prompt-len", "0"], "--prompt-len"),
    (["generate", "hi", "--num-scheduler-steps", "0"], "--num-scheduler-steps"),
    (["bench", "--num-scheduler-steps", "many"], "--num-scheduler-steps"),
])
def test_bad_values_name_the_option(capsys, argv, flag):
    last = _usage_error(capsys, argv).strip().splitlines()[-1]
    assert last.startswith("m3eagle ") and "error: argument " in last and flag in last, last


def test_bad_device_names_the_option(capsys):
    assert "argument --device" in _usage_error(capsys, ["generate", "hi", "--device", "tpu:0"])
    assert "argument --device" in _usage_error(capsys, ["bench", "--device", "cuda:99"])


# ---- library errors: one line, exit 2 -----------------------------------------------------------------


def test_missing_model_dir(capsys, tmp_path):
    line = _one_line_error(capsys, ["generate", "hi", "--device", "cpu", "--model", str(tmp_path / "nope")])
    assert "config.json" in line


def test_damaged_safetensors(capsys, tmp_path):
    (tmp_path / "config.json").write_bytes((TARGET / "config.json").read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    _one_line_error(capsys, ["generate", "hi", "--device", "cpu", "--model", str(tmp_path)])


def test_damaged_tokenizer(capsys, tmp_path):
    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).symlink_to(TARGET / f)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    _one_line_error(capsys, ["generate", "hi", "--device", "cpu", "--model", str(tmp_path), "--max-tokens", "2"])


def test_bench_prompt_longer_than_the_text(capsys, monkeypatch, tmp_path):
    from m3eagle.bench import offline

    short = tmp_path / "short.py"
    short.write_text("x = 1\n" * 4)
    monkeypatch.setattr(offline, "held_out_files", lambda: [short])
    line = _one_line_error(capsys, ["bench", "--device", "cpu", "--prompt-len", "64", "--batch-sizes", "1",
                                    "--repeats", "1", "--num-draft-tokens", "0"])
    assert "--prompt-len 64" in line


def test_bench_prompt_beyond_the_model(capsys):
    line = _one_line_error(capsys, ["bench", "--geometry", "tiny", "--device", "cpu", "--prompt-len", "5000"])
    assert "--prompt-len 5000" in line and "max_position_embeddings" in line


def test_bench_json_dir_missing(capsys, tmp_path):
    line = _one_line_error(capsys, ["bench", "--geometry", "tiny", "--json", str(tmp_path / "no" / "b.json")])
    assert "--json" in line


# ---- a closed stdout pipe ---------------------------------------------------------------------------


@pytest.mark.slow
def test_closed_stdout_pipe_exits_quietly():
    """`m3eagle generate ... | head -1`: the reader is gone before the first write; no traceback, no
    'Exception ignored' at interpreter exit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-m", "m3eagle", "generate", "def f", "import os", "--max-tokens", "2",
                          "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env)
    p.stdout.close()  # nobody will ever read stdout
    err = p.stderr.read().decode()
    p.wait(timeout=300)
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err
    assert p.returncode == 1


def test_warmup_and_prefill_graph_flags_reach_the_llm(monkeypatch):
    """--warmup / --[no-]prefill-graphs on an engine command build the LLM with warmup=True /
    prefill_graphs=True / False (None without them: the engine's default, on for one CUDA device);
    --max-prefill-graph-tokens reaches it too and must be >= 16."""
    from m3eagle.entrypoints import cli

    seen = []

    class FakeLLM:
        def __init__(self, **kw):
            seen.append((kw["warmup"], kw["prefill_graphs"], kw["max_prefill_graph_tokens"]))
            raise RuntimeError("stop here")

    monkeypatch.setattr("m3eagle.entrypoints.llm.LLM", FakeLLM)  # what _make_llm imports when it runs
    for argv in (["generate", "x", "--warmup"], ["generate", "x", "--prefill-graphs"],
                 ["generate", "x", "--no-prefill-graphs", "--max-prefill-graph-tokens", "256"], ["generate", "x"]):
        assert cli.main(argv) == 2  # the fake's error, reported as one line
    assert seen == [(True, None, 2048), (False, True, 2048), (False, False, 256), (False, None, 2048)]
    with pytest.raises(SystemExit):
        cli.main(["generate", "x", "--max-prefill-graph-tokens", "8"])


def test_num_scheduler_steps_flag_reaches_the_llm(monkeypatch):
    """--num-scheduler-steps: 1 unless given, an integer or 'auto' (the engine resolves it) as given."""
    from m3eagle.entrypoints import cli

    seen = []

    class FakeLLM:
        def __init__(self, **kw):
            seen.append(kw["num_scheduler_steps"])
            raise RuntimeError("stop here")

    monkeypatch.setattr("m3eagle.entrypoints.llm.LLM", FakeLLM)
    for argv in (["generate", "x"], ["generate", "x", "--num-scheduler-steps", "4"],
                 ["generate", "x", "--num-scheduler-steps", "auto"]):
        assert cli.main(argv) == 2
    assert seen == [1, 4, "auto"]


def test_structured_draft_masks_flag_reaches_the_llm(monkeypatch):
    """--structured-draft-masks on generate / serve builds the LLM with structured_draft_masks=True (False without
    it: drafts unmasked, constrained steps on CUDA graphs); bench accepts it too."""
    from m3eagle.entrypoints import cli

    seen = []

    class FakeLLM:
        def __init__(self, **kw):
            seen.append(kw["structured_draft_masks"])
            raise RuntimeError("stop here")

    monkeypatch.setattr("m3eagle.entrypoints.llm.LLM", FakeLLM)
    for argv in (["generate", "x"], ["generate", "x", "--structured-draft-masks"],
                 ["serve", "--port", "0", "--structured-draft-masks"]):
        assert cli.main(argv) == 2
    assert seen == [False, True, True]
    assert cli.build_parser().parse_args(["bench", "--structured-draft-masks"]).structured_draft_masks
