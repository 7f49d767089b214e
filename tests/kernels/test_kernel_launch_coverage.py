"""Every Triton kernel of the package has at least one launch in tests/data/kernel_launches.json.

tests/kernels/test_kernels_compile.py compiles for sm_90 only the launches recorded there; a kernel with no record
is never compiled off the GPU, and the interpreter the rest of the CPU suite runs accepts code the GPU compiler
rejects. The records come from `scripts/record_kernel_launches.py` (engine runs plus direct calls), so a new kernel,
or one only a mode the script does not run launches, shows here until the script launches it. Cheap: the kernels
are found from the source (every `@triton.jit` function named `*_kernel` in a module under m3eagle), nothing is
recorded or compiled.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "tests" / "data" / "kernel_launches.json"
RECORD_SCRIPT = "python scripts/record_kernel_launches.py"

# (module, kernel) -> why no launch of it is recorded. Keep empty unless the script cannot launch the kernel.
UNRECORDED: dict[tuple[str, str], str] = {}


def _is_triton_jit(dec: ast.expr) -> bool:
    """`@triton.jit` or `@triton.jit(...)` (also `@jit` imported from triton)."""
    target = dec.func if isinstance(dec, ast.Call) else dec
    if isinstance(target, ast.Attribute):
        return target.attr == "jit" and isinstance(target.value, ast.Name) and target.value.id == "triton"
    return isinstance(target, ast.Name) and target.id == "jit"


def source_kernels() -> set[tuple[str, str]]:
    """(module, name) of every `@triton.jit` function whose name ends with `_kernel`, from the package's source."""
    pkg = ROOT / "m3eagle"
    found = set()
    for path in sorted(pkg.rglob("*.py")):
        text = path.read_text()
        if "jit" not in text:
            continue
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(text, str(path))):
            if (isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel")
                    and any(_is_triton_jit(d) for d in node.decorator_list)):
                found.add((module, node.name))
    return found


def recorded_kernels() -> set[tuple[str, str]]:
    return {(r[0], r[1]) for r in json.loads(RECORDS.read_text())}


def test_the_discovery_finds_the_known_kernels():
    """The source scan sees kernels of every kind of module (a broken scan would pass the check below vacuously)."""
    found = source_kernels()
    assert {("m3eagle.kernels.fused.gemv", "_linear_kernel"), ("m3eagle.engine.tree_kernels", "_walk_kernel"),
            ("m3eagle.kernels.batch_invariant.matmul", "_matmul_kernel"),
            ("m3eagle.kernels.quant.w8a16", "_mx_moe_down_kernel"),
            ("m3eagle.kernels.attention.sparse_prefill", "_sparse_prefill_kernel")} <= found
    assert len(found) >= 40


def test_every_kernel_has_a_recorded_launch():
    """Each kernel defined in the package has >= 1 record (or a listed reason), and each listed exception is
    still a kernel without records."""
    found, recorded = source_kernels(), recorded_kernels()
    missing = sorted(found - recorded - UNRECORDED.keys())
    assert not missing, (f"Triton kernels with no launch in {RECORDS.relative_to(ROOT)} (so never compiled for "
                         f"sm_90 off the GPU): {missing}; make {RECORD_SCRIPT} launch them and re-run it")
    stale = sorted(k for k in UNRECORDED if k not in found or k in recorded)
    assert not stale, f"UNRECORDED entries that are gone or recorded now: {stale}"


def test_every_record_names_a_kernel_of_the_package():
    """No record of a kernel that was renamed, moved or deleted (re-record after removing one)."""
    gone = sorted(recorded_kernels() - source_kernels())
    assert not gone, f"records of kernels the source no longer defines: {gone}; re-run {RECORD_SCRIPT}"


def test_a_rerun_merges_into_the_records_and_drops_only_changed_signatures():
    """scripts/record_kernel_launches.py merges a run into the file: records no pass launched (kept by hand, or
    of passes not run) stay; a kernel recorded with other argument names loses its old records, which could no
    longer compile."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("record_kernel_launches", ROOT / "scripts" /
                                                  "record_kernel_launches.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    old = [["m.a", "_k1_kernel", ["x", "n"], {"x": "*fp32"}, {"B": 16}, {}],
           ["m.a", "_k1_kernel", ["x", "n"], {"x": "*fp32"}, {"B": 32}, {}],
           ["m.b", "_k2_kernel", ["y"], {"y": "*bf16"}, {"B": 8}, {}],
           ["m.c", "_kept_by_hand_kernel", ["z"], {"z": "*i32"}, {}, {}]]
    new = [["m.a", "_k1_kernel", ["x", "n", "flag"], {"x": "*fp32"}, {"B": 16}, {}],
           ["m.b", "_k2_kernel", ["y"], {"y": "*bf16"}, {"B": 64}, {}]]
    merged = script.merge(old, new)
    assert merged == [new[0], new[1], old[2], old[3]]  # sorted by module, kernel, then the rest (as JSON)
    records = json.loads(RECORDS.read_text())
    assert script.merge(records, records) == records  # the file is what a merge writes
