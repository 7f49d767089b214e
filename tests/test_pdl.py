"""Programmatic dependent launch (m3eagle/pdl.py) is opt-in and never reaches the CPU interpreter; every
Triton kernel of the engine waits for its predecessor before touching memory when it is on.

The wait-first rule is checked on the kernels' source (the GPU behaviour is the H200 run's: engine tokens
with PDL on equal those with it off, `scripts/h200_check.sh PDL_AB=1`); compiling each kernel with PDL on for
sm_90 is tests/test_kernels_compile.py's.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the first `import triton`, as every kernel test module does

import ast  # noqa: E402
import inspect  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from m3eagle import pdl  # noqa: E402  (imports triton)


def kernels():
    from m3eagle.attention import triton_kernels
    from m3eagle.fused import gemv, triton_fused
    from m3eagle.moe import align, direct, triton_moe

    for mod in (triton_kernels, triton_fused, gemv, triton_moe, align, direct):
        for name, fn in vars(mod).items():
            # a JITFunction, or an InterpretedFunction when another test module set TRITON_INTERPRET first
            if name.endswith("_kernel") and inspect.isfunction(getattr(fn, "fn", None)):
                yield f"{mod.__name__}.{name}", fn


def test_off_by_default_outside_graphs_and_off_the_gpu(monkeypatch):
    t = torch.zeros(1)
    monkeypatch.delenv("M3EAGLE_PDL", raising=False)
    assert pdl.args(t) == {"PDL": 0}
    monkeypatch.setenv("M3EAGLE_PDL", "1")
    assert pdl.args(t) == {"PDL": 0}  # CPU: no launch option, no wait (the interpreter knows neither)
    assert not pdl.enabled(torch.device("cpu"))


def test_launch_value_prefetches_weights_unless_switched_off(monkeypatch):
    """With PDL on, kernels get PDL = PREFETCH (prefetch weights into L2, then wait) unless
    M3EAGLE_PDL_PREFETCH=0 (WAIT: the wait alone); a bad value names the choices. Stubbed sm_90 device."""
    from types import SimpleNamespace

    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    monkeypatch.setenv("M3EAGLE_PDL", "1")
    t = SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.delenv("M3EAGLE_PDL_PREFETCH", raising=False)
    assert pdl.args(t) == {"PDL": pdl.PREFETCH, "launch_pdl": True}
    monkeypatch.setenv("M3EAGLE_PDL_PREFETCH", "0")
    assert pdl.args(t) == {"PDL": pdl.WAIT, "launch_pdl": True}
    monkeypatch.setenv("M3EAGLE_PDL_PREFETCH", "yes")
    with pytest.raises(ValueError, match="M3EAGLE_PDL_PREFETCH='yes'.*1.*0"):
        pdl.args(t)
    monkeypatch.setenv("M3EAGLE_PDL", "0")
    assert pdl.args(t) == {"PDL": 0}  # off: the prefetch switch is not even read
    assert (pdl.WAIT, pdl.PREFETCH) == (1, 2)  # prefetch_rows tests PDL == 2 inside the kernels


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


# Kernels that read, before their wait, metadata written two or more launches back (m3eagle/pdl.py says why
# that is safe): the routed experts' ids / the alignment's blocks, written before the gate_up launch that
# precedes each of these.
READ_BEFORE_WAIT = {"m3eagle.moe.direct._direct_down_kernel", "m3eagle.moe.triton_moe._down_kernel"}


PURE_BEFORE_WAIT = {"tl.program_id", "tl.arange", "tl.minimum", "tl.maximum", "tl.where", "tl.max", "tl.reshape",
                    "tl.cdiv", "_block_coords", "_expert_base", "prefetch_rows"}


def _calls(node: ast.AST) -> list[ast.Call]:
    return [c for c in ast.walk(node) if isinstance(c, ast.Call)]


def test_every_kernel_waits_before_touching_memory_when_pdl_is_on():
    """Every kernel runs `pdl_wait(PDL)` (wait, then trigger) at its top level before anything that can
    race its predecessor: a kernel that touched memory before waiting could read what its predecessor has
    not written yet, or overwrite what it still reads, once launched early; one that triggered before
    waiting would let its successor start before its own predecessor ended. Before the wait a kernel may
    only compute addresses, prefetch weights into L2 (`prefetch_rows`, a hint that loads nothing) and --
    the kernels of READ_BEFORE_WAIT only -- load with `.cg`: no store, atomic, early return or other load."""
    seen = 0
    for name, fn in kernels():
        tree = ast.parse(inspect.getsource(fn.fn).lstrip())
        body = tree.body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        waits = [i for i, st in enumerate(body) if ast.unparse(st) == "pdl_wait(PDL)"]
        assert len(waits) == 1, name
        assert "PDL" in inspect.signature(fn.fn).parameters, name
        for st in body[:waits[0]]:
            assert not any(isinstance(n, ast.Return) for n in ast.walk(st)), (name, ast.unparse(st))
            for call in _calls(st):
                f = ast.unparse(call.func)
                if f == "tl.load":
                    cache = {k.arg: ast.unparse(k.value) for k in call.keywords}.get("cache_modifier")
                    assert name in READ_BEFORE_WAIT and cache == "'.cg'", (name, ast.unparse(call))
                elif isinstance(call.func, ast.Attribute) and call.func.attr == "to":
                    pass  # a cast
                else:  # address arithmetic, or a helper known not to touch memory (a new one is reviewed here)
                    assert f in PURE_BEFORE_WAIT, (name, f)
        seen += 1
    assert seen >= 26
    # the reading kernels are those the rule was written for (a rename must revisit the argument)
    assert READ_BEFORE_WAIT <= {name for name, _ in kernels()}
    # and the helper waits before it triggers
    helper = ast.parse(inspect.getsource(pdl.pdl_wait.fn)).body[0].body[1]  # after the docstring
    assert ast.unparse(helper.test) == "PDL"
    assert [ast.unparse(x) for x in helper.body] == ["tl.extra.cuda.gdc_wait()",
                                                     "tl.extra.cuda.gdc_launch_dependents()"]


def test_graph_runner_captures_small_decode_buckets_with_pdl():
    from m3eagle.engine.graph_runner import PREFILL, pdl_in_graph

    assert [b for b in (1, 2, 4, 8, 16, 32) if pdl_in_graph(b)] == [1, 2, 4]
    assert not pdl_in_graph((PREFILL, 1, 64)) and not pdl_in_graph(None)
