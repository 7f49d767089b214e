"""`m3eagle bench` on CPU: the profiler's native `USDT ... profiler_start` lines stay
out of the output, the bandwidth buffer the log names is the one the table and the JSON name (the size
actually used: capped on CPU), and the Eagle3 head's parameter count is one definition in the log, the
table, the JSON and `generate`'s load line."""

from __future__ import annotations

import json
import re

from m3eagle.entrypoints.cli import main

ARGS = ["bench", "--geometry", "tiny", "--device", "cpu", "--prompt-len", "16", "--max-tokens", "2",
        "--repeats", "1", "--decode-steps", "1", "--profile-steps", "1", "--batch-sizes", "1"]


def test_bench_cpu_output_is_consistent(capfd, one_thread):
    rc = main(ARGS)  # the default --bandwidth-gib 4, capped on CPU
    out, err = capfd.readouterr()
    assert rc == 0, err
    doc = json.loads(out)
    assert "USDT" not in err and "profiler_start" not in err, err
    used = doc["bandwidth"]["buffer_bytes"] / 2**30
    logged = [float(x) for x in re.findall(r"([0-9.]+) GiB buffer", err)]
    assert logged and all(abs(x - used) < 1e-9 for x in logged), (logged, used, err)
    loaded = re.search(r"loaded Eagle3 draft .*?: ([0-9.]+)M parameters", err)
    assert loaded, err
    assert float(loaded.group(1)) == round(doc["geometry"]["draft_params"] / 1e6, 2), (loaded.group(0),
                                                                                     doc["geometry"]["draft_params"])
    assert "draft_params" in doc["definitions"]
