"""Programmatic dependent launch (m3eagle/kernels/pdl.py) is opt-in and never reaches the CPU interpreter; every
Triton kernel of the engine waits for its predecessor before touching memory when it is on.

The wait-first rule is checked on the kernels' source (the GPU behaviour is the H200 run's: engine tokens
with PDL on equal those with it off, `scripts/h200_check.sh PDL_AB=1`); compiling each kernel with PDL on for
sm_90 is tests/kernels/test_kernels_compile.py's.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the first `import triton`, as every kernel test module does

import ast  # noqa: E402
import importlib  # noqa: E402
import inspect  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import m3eagle  # noqa: E402
from m3eagle.kernels import pdl  # noqa: E402  (imports triton)


def kernel_modules() -> list[str]:
    """Every module of the package that defines a Triton kernel (found from the source, so a new kernel file is
    checked without being listed here)."""
    root = Path(m3eagle.__file__).parent
    return sorted("m3eagle." + ".".join(f.relative_to(root).with_suffix("").parts)
                  for f in root.rglob("*.py") if "@triton.jit" in f.read_text())


def kernels():
    for modname in kernel_modules():
        mod = importlib.import_module(modname)
        for name, fn in vars(mod).items():
            # a JITFunction, or an InterpretedFunction when another test module set TRITON_INTERPRET first
            if name.endswith("_kernel") and inspect.isfunction(getattr(fn, "fn", None)):
                yield f"{mod.__name__}.{name}", fn


def test_off_by_default_outside_graphs_and_off_the_gpu(monkeypatch):
    t = torch.zeros(1)
    monkeypatch.delenv("M3EAGLE_PDL", raising=False)
    assert pdl.args(t) == {"PDL": False}
    monkeypatch.setenv("M3EAGLE_PDL", "1")
    assert pdl.args(t) == {"PDL": False}  # CPU: no launch option, no wait (the interpreter knows neither)
    assert not pdl.enabled(torch.device("cpu"))


def test_modes_and_the_small_bucket_scope(monkeypatch):
    """M3EAGLE_PDL: 1 everywhere, 0 nowhere, unset / auto only inside `pdl.scope(True)` (the GraphRunner's
    captures of small batch buckets); a bad value names the choices. The device check is stubbed to sm_90."""
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    cuda = torch.device("cuda", 0)
    for env, outside, inside in (("auto", False, True), ("", False, True), ("1", True, True), ("0", False, False)):
        monkeypatch.setenv("M3EAGLE_PDL", env)
        assert pdl.enabled(cuda) is outside, env
        with pdl.scope(True):
            assert pdl.enabled(cuda) is inside, env
            with pdl.scope(False):
                assert pdl.enabled(cuda) is outside, env
        assert pdl.enabled(cuda) is outside, env
    monkeypatch.delenv("M3EAGLE_PDL")
    with pdl.scope(True):
        assert pdl.enabled(cuda)
        assert not pdl.enabled(torch.device("cpu"))
    monkeypatch.setenv("M3EAGLE_PDL", "yes")
    with pytest.raises(ValueError, match="M3EAGLE_PDL='yes'.*1.*0.*auto"):
        pdl.enabled(cuda)


# The first exception (its weight stream overlaps gate_up's last wave): with PRELOAD, direct down reads its
# routing and its weight tiles before the wait -- weights no kernel writes, and idx written two launches back.
# Only those.
PRELOADING = {"m3eagle.kernels.moe.direct._direct_down_kernel": ({"idx_ptr + pair"}, {"w_ptrs", "s_ptrs"}),
              # the same exception with ROWS column tiles per program: the routing and the first tile only
              "m3eagle.kernels.moe.direct._direct_down_rows_kernel": (
                  {"idx_ptr + pair"}, {"w_base + rows.to(tl.int64)[None, :, None] * stride_wh",
                                       "s_base + rows.to(tl.int64)[:, None] * stride_swh"})}
LOAD_HELPERS = {"_load_k", "_router_w_tile"}  # jit helpers that load their first argument

# The third (pdl.preload_weights: its predecessors at batch 1 are latency-bound and stream little): with
# PRELOAD the decode GEMV's first weight tile and the router's expert rows are read before the wait; x, the
# counters and every store after it.
WEIGHT_PRELOAD = {"m3eagle.kernels.fused.gemv._linear_kernel", "m3eagle.kernels.moe.router._router_topk_kernel",
                  "m3eagle.kernels.moe.direct._route_shared_kernel"}

# The second exception (moe/direct.py, the same overlap): with SD the routed gate_up launch's shared-down programs
# load their weights before their wait (`_shared_down_program`); every other program waits at once.
SHARED_DOWN = {"m3eagle.kernels.moe.direct._direct_gate_up_rows_kernel"}


def _memory_calls(stmts) -> list[tuple[str, str]]:
    """(tl function, first argument) of every tl.load / store / atomic in `stmts`, in source order."""
    out = []
    for st in stmts:
        for node in ast.walk(st):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Attribute) and (f.attr in ("load", "store") or f.attr.startswith("atomic")):
                out.append((f.attr, ast.unparse(node.args[0])))
            elif isinstance(f, ast.Name) and f.id in LOAD_HELPERS:
                out.append(("load", ast.unparse(node.args[0])))
    return out


def _check_preload(name: str, body: list) -> None:
    """`if not PRELOAD: pdl_wait(PDL)` first; before the `if PRELOAD:` branch only the allowed loads; inside
    it only the allowed loads before its own `pdl_wait(PDL)`; no store or atomic before a wait."""
    before_ok, branch_ok = PRELOADING[name]
    assert ast.unparse(body[0]) == "if not PRELOAD:\n    pdl_wait(PDL)", name
    i = next(i for i, st in enumerate(body) if isinstance(st, ast.If) and ast.unparse(st.test) == "PRELOAD")
    early = _memory_calls(body[1:i])
    assert early and all(f == "load" and a in before_ok for f, a in early), (name, early)
    branch = body[i].body
    w = next(j for j, st in enumerate(branch) if ast.unparse(st) == "pdl_wait(PDL)")
    pre = _memory_calls(branch[:w])
    assert pre and all(f == "load" and a in branch_ok for f, a in pre), (name, pre)


def _calls(stmts) -> list[str]:
    return [ast.unparse(n.func) for st in stmts for n in ast.walk(st) if isinstance(n, ast.Call)]


def _check_shared_down(name: str, body: list) -> None:
    """`if not SD: pdl_wait(PDL)` first; then, touching no memory, the SD branch: the shared-down programs
    call `_shared_down_program` and return, every other program waits at once; the helper loads only its
    weight tiles before its own wait."""
    from m3eagle.kernels.moe import direct

    assert ast.unparse(body[0]) == "if not SD:\n    pdl_wait(PDL)", name
    i_sd = next(i for i, st in enumerate(body) if isinstance(st, ast.If) and ast.unparse(st.test) == "SD")
    assert not _memory_calls(body[1:i_sd + 1]), name
    sd = body[i_sd].body
    assert ast.unparse(sd[0].test) == "p >= T * TOP_K" and isinstance(sd[0].body[-1], ast.Return)
    assert [c for c in _calls(sd[0].body) if not c.startswith("tl.")] == ["_shared_down_program"]
    assert ast.unparse(sd[1]) == "pdl_wait(PDL)" and len(sd) == 2
    helper = ast.parse(inspect.getsource(direct._shared_down_program.fn)).body[0].body[1:]  # after the docstring
    w = next(j for j, st in enumerate(helper) if ast.unparse(st) == "pdl_wait(PDL)")
    pre = _memory_calls(helper[:w])
    assert len(pre) == 4 and all(f == "load" and a.startswith("base + ") for f, a in pre), pre


def _helpers(stmts) -> list[str]:
    """The jit helpers (plain names, not tl.* or methods) that `stmts` call."""
    return [n.func.id for st in stmts for n in ast.walk(st) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]


def _preload_branch(stmts, allowed: set[str]) -> None:
    """An `if PRELOAD:` whose statements before its `pdl_wait(PDL)` only load `allowed` (weights)."""
    w = next(j for j, st in enumerate(stmts) if ast.unparse(st) == "pdl_wait(PDL)")
    pre = _memory_calls(stmts[:w])
    assert pre and all(f == "load" and a in allowed for f, a in pre), pre


def _router_program_preloads_rows_only() -> None:
    from m3eagle.kernels.moe import router

    body = ast.parse(inspect.getsource(router.router_topk_program.fn)).body[0].body[1:]
    i = next(i for i, st in enumerate(body) if isinstance(st, ast.If) and ast.unparse(st.test) == "PRELOAD")
    assert not _memory_calls(body[:i])
    _preload_branch(body[i].body, {"w_ptr"})
    assert "pdl_wait" not in _calls(body[i].orelse)  # the kernel waited already


def _check_weight_preload(name: str, body: list) -> None:
    """`if not PRELOAD: pdl_wait(PDL)` first; with PRELOAD only weight loads before each program's wait."""
    assert ast.unparse(body[0]) == "if not PRELOAD:\n    pdl_wait(PDL)", name
    if name.endswith("_linear_kernel"):
        i = next(i for i, st in enumerate(body) if isinstance(st, ast.If) and ast.unparse(st.test) == "PRELOAD")
        assert not _memory_calls(body[1:i]), name
        _preload_branch(body[i].body, {"w_ptrs"})
        return
    _router_program_preloads_rows_only()
    if name.endswith("_router_topk_kernel"):
        # a loop over the program's tokens, each one token's program (which waits in its PRELOAD branch)
        assert not _memory_calls(body[1:]) and _helpers(body[1:]) == ["range", "router_topk_program"], name
        return
    i = next(i for i, st in enumerate(body) if isinstance(st, ast.If) and ast.unparse(st.test) == "pid < n_router")
    assert not _memory_calls(body[1:i + 1]), name  # the router branch only calls the program (checked above)
    assert _helpers(body[i].body) == ["router_topk_program"], name
    # the shared expert's programs: `_gate_up_rows` with PRELOAD reads only its first gate / up tiles first
    assert _helpers(body[i].orelse) == ["_gate_up_rows"], name
    call = next(n for st in body[i].orelse for n in ast.walk(st) if isinstance(n, ast.Call))
    assert [ast.unparse(a) for a in call.args[-2:]] == ["PRELOAD", "PDL"], name
    from m3eagle.kernels.moe import direct

    helper = ast.parse(inspect.getsource(direct._gate_up_rows.fn)).body[0].body[1:]
    j = next(j for j, st in enumerate(helper) if isinstance(st, ast.If) and ast.unparse(st.test) == "PRELOAD")
    assert not _memory_calls(helper[:j])
    _preload_branch(helper[j].body, {"g_ptrs", "u_ptrs"})


def test_every_kernel_waits_first_when_pdl_is_on():
    """The first statement of every kernel (after its docstring) is `pdl_wait(PDL)`, which waits, then
    triggers: a kernel that touched memory before waiting could race its predecessor once launched early,
    and one that triggered before waiting would let its successor start before its own predecessor ended."""
    seen = 0
    for name, fn in kernels():
        tree = ast.parse(inspect.getsource(fn.fn).lstrip())
        body = tree.body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        assert "PDL" in inspect.signature(fn.fn).parameters, name
        seen += 1
        if name in PRELOADING:
            _check_preload(name, body)
            continue
        if name in SHARED_DOWN:
            _check_shared_down(name, body)
            continue
        if name in WEIGHT_PRELOAD:
            _check_weight_preload(name, body)
            continue
        assert ast.unparse(body[0]) == "pdl_wait(PDL)", name
    assert seen >= 40  # every kernel file is found (46 kernels when this was written)
    # and the helper waits before it triggers
    helper = ast.parse(inspect.getsource(pdl.pdl_wait.fn)).body[0].body[1]  # after the docstring
    assert ast.unparse(helper.test) == "PDL"
    assert [ast.unparse(x) for x in helper.body] == ["tl.extra.cuda.gdc_wait()",
                                                     "tl.extra.cuda.gdc_launch_dependents()"]


def test_graph_runner_captures_small_decode_buckets_with_pdl():
    from m3eagle.engine.graph_runner import PREFILL, pdl_in_graph

    assert [b for b in (1, 2, 4, 8, 16, 32) if pdl_in_graph(b)] == [1, 2, 4]
    assert not pdl_in_graph((PREFILL, 1, 64)) and not pdl_in_graph(None)
