"""Shared by the benchmark scripts: pick the Triton interpreter for `--device cpu` runs.

Triton kernels are decorated when their module is imported, so TRITON_INTERPRET must be set before the
first `import triton`: a script imports this module first and calls `use_interpreter_for_cpu(sys.argv)`.
"""

from __future__ import annotations

import os


def device_arg(argv: list[str]) -> str:
    """The value of --device in argv ('cuda' when absent), read before argparse runs."""
    for i, a in enumerate(argv):
        if a == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--device="):
            return a.split("=", 1)[1]
    return "cuda"


def use_interpreter_for_cpu(argv: list[str]) -> None:
    if device_arg(argv) == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
