"""The post-compile hook: listeners hear each compiled variant, an earlier hook still runs, removal and a
collected listener's owner stop the calls. Triton calls the hook with these keyword arguments after a compile;
the test calls it the same way (the CPU interpreter compiles nothing)."""

from __future__ import annotations

import gc
import logging
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`, as every CPU kernel test

import triton  # noqa: E402

from m3eagle.kernels import compile_watch  # noqa: E402
from tests.helpers.engine_utils import m3eagle_records  # noqa: E402


def _fire(variant: str) -> None:
    triton.knobs.runtime.jit_post_compile_hook(key=("k",), repr=variant, fn=None, compile={},
                                               is_manual_warmup=False, already_compiled=False)


class _Owner:
    def __init__(self) -> None:
        self.heard: list[str] = []

    def on_compile(self, variant: str) -> None:
        self.heard.append(variant)


def test_listeners_hear_compiles_until_removed_or_collected():
    owner, other = _Owner(), _Owner()
    remove = compile_watch.add_compile_listener(owner.on_compile)
    remove_other = compile_watch.add_compile_listener(other.on_compile)
    _fire("_matmul_kernel[num_warps=4](X: *bf16)")
    assert owner.heard == other.heard == ["_matmul_kernel[num_warps=4](X: *bf16)"]
    remove()
    _fire("_argmax_kernel")
    assert owner.heard == ["_matmul_kernel[num_warps=4](X: *bf16)"] and other.heard[-1] == "_argmax_kernel"
    del other
    gc.collect()
    _fire("_combine_kernel")  # the collected owner's entry is dropped, nothing raises
    assert all(ref() is not None for ref in compile_watch._listeners)
    remove_other()


def test_an_earlier_hook_keeps_running(monkeypatch):
    calls = []
    monkeypatch.setattr(compile_watch, "_installed", False)
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", lambda **kw: calls.append(kw["repr"]))
    owner = _Owner()
    remove = compile_watch.add_compile_listener(owner.on_compile)
    _fire("_dense_attn_kernel")
    assert calls == ["_dense_attn_kernel"] and owner.heard == ["_dense_attn_kernel"]
    remove()


def test_the_engine_logs_a_compile_after_its_warm_up(make_llm, model_dir):
    llm = make_llm(model_dir, num_draft_tokens=0)
    eng = llm.engine
    remove = compile_watch.add_compile_listener(eng._first_use_compile)  # what warmup() installs on CUDA
    try:
        with m3eagle_records() as records:
            _fire("_linear_kernel[num_warps=8](X: *bf16, W: *bf16)")
    finally:
        remove()
    assert eng.first_use_compiles == 1
    assert [r.levelno for r in records if "_linear_kernel[num_warps=8]" in r.getMessage()
            and "after the warm-up" in r.getMessage()] == [logging.WARNING]


def test_a_multi_line_variant_is_heard_on_one_line():
    """Triton's repr puts an argument per line; a log line of the first alone would not say which constexpr
    values compiled (BLOCK_C of the index merge, say), so the listener hears the whole variant on one line."""
    owner = _Owner()
    remove = compile_watch.add_compile_listener(owner.on_compile)
    try:
        _fire("_index_merge_kernel[num_warps=4](PartKey: (\n  '*i64',\n)\n  BLOCK_C: 512,\n)")
    finally:
        remove()
    assert owner.heard == ["_index_merge_kernel[num_warps=4](PartKey: ( '*i64', ) BLOCK_C: 512, )"]
