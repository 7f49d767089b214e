"""Every recorded Triton launch compiles for the H200 (sm_90) -- on a machine without a GPU.

The rest of the CPU suite runs the kernels under the Triton interpreter, which accepts code the GPU
compiler rejects (tl.dot tiles under 16, layouts and types only the compiler checks).
tests/data/kernel_launches.json holds each distinct launch of interpreted engine runs -- bf16 with every fast
path on, the deterministic mode, MXFP8 weights, a draft tree -- and direct calls for the shapes they do not take
(kernel, argument types, constexprs, launch options; `scripts/record_kernel_launches.py` writes it, and
tests/kernels/test_kernel_launch_coverage.py requires a record of every kernel of the package); here
each is compiled with Triton's own CUDA toolchain (ptxas ships with the triton wheel) in a subprocess
without TRITON_INTERPRET, with programmatic dependent launch on (m3eagle/kernels/pdl.py): a kernel's PDL constexpr
only adds its `griddepcontrol` instructions (`pdl_wait`), so the variant with them compiles everything the
recorded one (PDL off) does, and the suite compiles each launch once. The recorded dense, sparse and indexer
launches (TAIL off) are also compiled with TAIL on -- what a draft-tree step launches on the GPU
(tests/kernels/test_triton_tree_attention.py) -- in the same pass. A kernel with a PRECISE constexpr is
compiled with it on, as a GPU launches it (`triton_utils.precise()`: libdevice math, bf16 dots), not with the
interpreter's setting it was recorded under, which no GPU runs; likewise UPCAST_DOT (the interpreter's fp32 dots
for bf16 / fp16) is compiled off.
A record whose kernel's parameters changed fails with the command that re-records them. Skipped where
triton has no CUDA backend.

It compiles with the installed triton (CI installs the newest), not the H200 machine's 3.6: a construct
only an older compiler refuses still needs the GPU run to show (a jit helper with a defaulted constexpr
parameter compiled here with triton 3.9 and failed on the H200 with 3.6; checked by reintroducing it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "tests" / "data" / "kernel_launches.json"

COMPILE = r"""
import importlib, inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

try:  # the CUDA backend and its ptxas (get_ptxas takes the arch in newer triton)
    from triton.backends.nvidia.compiler import get_ptxas
    try:
        get_ptxas(90)
    except TypeError:
        get_ptxas()
except Exception as e:  # no CUDA backend or no ptxas: nothing to check here
    print(f"SKIP {type(e).__name__}: {e}")
    sys.exit(77)
import os
WEIGHT_PRELOAD = {"_linear_kernel", "_router_topk_kernel", "_route_shared_kernel"}
failures, stale = [], []
records, claims = json.load(open(sys.argv[1])), sys.argv[2]


def claimed():  # a work queue shared by the compiler processes: each record goes to the first one to claim it
    for i, record in enumerate(records):
        try:
            os.close(os.open(os.path.join(claims, str(i)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        yield record


for mod, name, params, types, consts, opts in claimed():
    fn = getattr(importlib.import_module(mod), name)
    now = list(inspect.signature(fn.fn).parameters)
    if now != params:
        stale.append(f"{mod}.{name}")
        continue
    sig = {p: ("constexpr" if p in consts else types[p]) for p in params}
    variants = [(consts, opts)]
    if "PDL" in consts:  # recorded off the GPU (PDL off): the programmatic-dependent-launch variant, a superset
        pdl_consts = {**consts, "PDL": True}
        if "PRELOAD" in consts and name in WEIGHT_PRELOAD and not consts.get("USE_DOT"):
            # as a GPU launches it under PDL (pdl.preload_weights): weights read before the wait
            pdl_consts.update(PRELOAD=True, **({"PREFETCH": True} if "PREFETCH" in consts else {}))
        variants = [(pdl_consts, {**opts, "launch_pdl": True})]
    if "PRECISE" in consts:  # recorded under the interpreter (numpy math, fp32 dots): the GPU's libdevice variant
        variants = [({**c, "PRECISE": True}, o) for c, o in variants]
    for c, o in variants:
        src = ASTSource(fn, sig, constexprs={(params.index(k),): v for k, v in c.items()})
        try:
            triton.compile(src, target=GPUTarget("cuda", 90, 32), options=o)
        except Exception as e:
            failures.append(f"{mod}.{name} {c}: {type(e).__name__}: {str(e)[:1500]}")
print(json.dumps({"failures": failures, "stale": sorted(set(stale))}))
"""


SHARDS = 2  # compiler processes at once: the suite's runner has two cores, and this test is its longest
# compiled first, so the shared queue ends on short compiles: these take most of the pass (up to ~25 s each)
COSTLY = ("_router_tile_kernel",)


def launches() -> list:
    """The recorded launches, and the TAIL-on variant of each one that has a TAIL constexpr (off when recorded).
    UPCAST_DOT (the interpreter's fp32 dots: on in bf16 / fp16 records) is compiled off, as every GPU launches it;
    launches that are then equal are compiled once."""
    records = [[mod, name, params, types, {**consts, "UPCAST_DOT": False} if "UPCAST_DOT" in consts else consts, opts]
               for mod, name, params, types, consts, opts in json.loads(RECORDS.read_text())]
    tails = [[mod, name, params, types, {**consts, "TAIL": True}, opts]
             for mod, name, params, types, consts, opts in records if "TAIL" in consts]
    assert {r[1] for r in tails} == {"_dense_attn_kernel", "_sparse_attn_kernel", "_indexer_kernel"}
    distinct = list({json.dumps(r, sort_keys=True): r for r in records + tails}.values())
    return sorted(distinct, key=lambda r: r[1] not in COSTLY)  # stable: otherwise the recorded order


@pytest.mark.slow
def test_every_recorded_launch_compiles_for_sm90(tmp_path):
    """Every recorded launch (PDL on), and the TAIL-on variant of each dense, sparse and indexer launch,
    compiles for sm_90 to a cubin, in SHARDS compiler processes that share one queue of launches."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, not from a cache
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton >= 3.9 warns when unset; 1 is its default
    path, claims = tmp_path / "launches.json", tmp_path / "claims"
    path.write_text(json.dumps(launches()))
    claims.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", COMPILE, str(path), str(claims)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(SHARDS)]
    outs = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    if any(rc == 77 for _, _, rc in outs):
        pytest.skip(next(out for out, _, rc in outs if rc == 77).strip())
    assert len(list(claims.iterdir())) == len(launches())  # every launch was taken by a compiler process
    stale, failures = [], []
    for out, err, rc in outs:
        assert rc == 0, err[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        stale += result["stale"]
        failures += result["failures"]
    assert not stale, (f"kernels whose parameters changed since the launches were recorded: "
                       f"{sorted(set(stale))}; re-record: python scripts/record_kernel_launches.py")
    assert not failures, "\n".join(failures)


def test_the_records_cover_the_decode_path():
    """The recording saw the kernels of a speculative decode step with every fast path on and those of a draft-tree
    step, and every kernel takes the PDL constexpr (m3eagle/kernels/pdl.py: a kernel launched with PDL must wait
    before touching memory)."""
    records = json.loads(RECORDS.read_text())
    names = {r[1] for r in records}
    assert all("PDL" in r[4] for r in records), sorted({r[1] for r in records if "PDL" not in r[4]})
    assert {"_linear_kernel", "_gate_up_kernel", "_down_kernel", "_place_kernel", "_router_topk_kernel",
            "_dense_attn_kernel", "_sparse_attn_kernel", "_indexer_kernel", "_add_norm_kernel",
            "_qkv_rope_kernel", "_step_inputs_kernel", "_commit_kernel", "_router_tile_kernel"} <= names
    # a draft-tree step's own kernels (engine/tree_ops.py 'triton'), recorded from an engine tree step
    assert {"_topk_kernel", "_walk_kernel", "_finish_kernel", "_compact_kernel", "_node_rows_kernel", "_frontier_kernel",
            "_path_perm_kernel", "_store_kernel"} <= names
