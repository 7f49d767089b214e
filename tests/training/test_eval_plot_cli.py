"""`m3eagle eval --plot` without matplotlib: one line on stderr and exit 2, before
anything is loaded or run."""

from __future__ import annotations

import sys

from m3eagle.entrypoints.cli import main


def test_eval_plot_without_matplotlib_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    rc = main(["eval", "--quick", "--plot", str(tmp_path / "acc.png")])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("m3eagle: error: "), err
    assert "m3eagle[plot]" in lines[0]
