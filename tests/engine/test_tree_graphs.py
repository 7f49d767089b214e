"""Draft trees on the graph path: the tree step reads nothing back to the host (fixed shapes, device-side node
layout), so it can be captured; padded to graph buckets with the fixed KV bound (what a CUDA replay computes,
`graph_shapes=True` on CPU) it gives the plain greedy tokens, on the tiny sparse geometry and with scripted
trees that force full, partial and rejected paths."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (see test_triton_attention.py)

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.engine.test_draft_tree import scripted_trees, tiny_tree_and_reference  # noqa: E402

# What would make a device step wait for the device (or copy from pageable host memory) on CUDA.
_SYNCS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero")


class _NoSync:
    """Inside the block, every host read of a tensor value and every tensor built from host data raises;
    `allowed()` lifts that for test code that runs inside the step (the scripted trees)."""

    active: _NoSync | None = None

    def __enter__(self):
        self.saved = {name: getattr(torch.Tensor, name) for name in _SYNCS}
        self.made = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}
        self._patch()
        _NoSync.active = self
        return self

    def _patch(self):
        def refuse(name):
            def fail(*_a, **_k):
                raise AssertionError(f"host sync in the tree step: Tensor.{name} / torch.{name}")
            return fail

        for name in self.saved:
            setattr(torch.Tensor, name, refuse(name))
        for name in self.made:
            setattr(torch, name, refuse(name))

    def _restore(self):
        for name, f in self.saved.items():
            setattr(torch.Tensor, name, f)
        for name, f in self.made.items():
            setattr(torch, name, f)

    def __exit__(self, *exc):
        self._restore()
        _NoSync.active = None
        return False

    @classmethod
    def allowed(cls, fn):
        """fn, run with the guard lifted while it runs."""
        def run(*a, **k):
            guard = cls.active
            if guard is None:
                return fn(*a, **k)
            guard._restore()
            try:
                return fn(*a, **k)
            finally:
                guard._patch()
        return run


def _guard_execute(llm, counts: dict[str, int]) -> None:
    """Run every tree step of `llm` under _NoSync, counting decode-only steps (every row verifies a tree) and
    mixed ones."""
    runner = llm.engine.runner
    orig = runner.execute

    def execute(inp):
        kind = "decode" if bool((inp.row_num_drafts > 0).all()) else "mixed"
        counts[kind] = counts.get(kind, 0) + 1
        with _NoSync():
            return orig(inp)

    runner.execute = execute


@pytest.mark.parametrize("graph_shapes", [False], ids=["eager"])
def test_tree_step_is_sync_free_and_greedy_exact(graph_shapes):
    """Every tree step -- decode-only and mixed with prompt rows -- runs without a host read of a device value
    or a tensor built from host data, and the tokens are the plain greedy ones (the tiny geometry: MSA block
    selection active past 16 tokens), also with scripted trees."""
    tree, prompts, sp, ref, vocab = tiny_tree_and_reference("3,3,8", 7, (30, 41, 19), 20)
    if graph_shapes:
        tree = _same_with(tree, graph_shapes=True)
    counts: dict[str, int] = {}
    _guard_execute(tree, counts)
    assert [o.outputs[0].token_ids for o in tree.generate(prompts, sp)] == ref
    used = scripted_trees(tree, {tuple(p): p + r for p, r in zip(prompts, ref)}, vocab)
    tree.engine.runner._grow_tree = _NoSync.allowed(tree.engine.runner._grow_tree)  # the script reads tokens
    assert [o.outputs[0].token_ids for o in tree.generate(prompts, sp)] == ref
    assert set(used) == {0, 1, 2} and tree.engine.counters.accept_hist[3] > 0
    assert counts.get("decode", 0) > 5 and counts.get("mixed", 0) > 0, counts
    tree.engine.check_integrity()


def _same_with(llm, **kw):
    """An LLM on the same weights and tree as `llm`, with other engine options."""
    from m3eagle import LLM
    from m3eagle.bench.geometries import tiny

    t, h = tiny()
    return LLM(t, draft=h, draft_tree=str(llm.engine.runner.tree), device="cpu", load_format="dummy",
               max_model_len=160, page_size=8, **kw)
