"""Kernel launches of one graph-shaped draft-tree decode step, counted on the CPU, split into the models' own
launches and the tree's bookkeeping (construction, layout, verification walk, KV compaction, slot commits).

    python benchmarks/tree_step_ops.py [--tree 3,4,16] [--batch 1] [--tree-ops reference|triton] [--narrow] [--names]

A decode step of the embedded pair (graph-shaped: padded to its bucket as a CUDA replay would be) runs under a
dispatch-mode counter: every aten op that computes (not a view, not a bare allocation) is one launch, and so
is every Triton kernel launch (run under the interpreter; its own host copies are not counted). Launches
inside the target's and the head's forwards, their logits and the target's greedy argmax are the models';
everything else in `TreeModelRunner.execute` is the tree's. The models run on the reference backends (the
GPU's model launches are measured there, not here); the step's bookkeeping runs the implementation named by
--tree-ops (the fused Triton kernels a CUDA engine takes, or the plain torch reference). `head_calls` counts the
head's forwards and `head_rows` the rows they output (B at step 0, B * K per frontier level; B per level when
the step grows a chain). --narrow forces every step narrow (tree_max_batch=0: verify the first D nodes, grow a
D-node chain for the next step). One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`: kernels run on the CPU

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from m3eagle import LLM, SamplingParams  # noqa: E402


class LaunchCounter(TorchDispatchMode):
    """Aten ops that compute (not views, not bare allocations) and Triton launches, by region: `model` while a
    model call runs (`pause_for_model`), `tree` otherwise."""

    SKIP = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
            "_local_scalar_dense", "set_", "resize_"}

    def __init__(self) -> None:
        super().__init__()
        self.region = "tree"
        self.counts: dict[str, int] = {"tree": 0, "model": 0, "head_calls": 0, "head_rows": 0}
        self.names: dict[str, int] = {}
        self.in_triton = False

    def add(self, name: str) -> None:
        self.counts[self.region] += 1
        if self.region == "tree":
            self.names[name] = self.names.get(name, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.in_triton and not func.is_view and name not in self.SKIP:
            self.add(name)
        return func(*args, **(kwargs or {}))

    def model_region(self, fn: Callable[..., Any], head: bool = False) -> Callable[..., Any]:
        """fn, its launches counted as the model's; with `head`, its calls and output rows counted too."""
        def run(*a, **k):
            saved, self.region = self.region, "model"
            try:
                out = fn(*a, **k)
            finally:
                self.region = saved
            if head:
                self.counts["head_calls"] += 1
                self.counts["head_rows"] += out[0].shape[0]  # (h_out [rows, H], h_next)
            return out
        return run


def count_tree_step(llm: LLM, prompts: list[list[int]], sp: SamplingParams, tree_ops: str | None = None,
                    ) -> tuple[dict[str, int], dict[str, int]]:
    """Launches of the last decode-only tree step of generate(prompts, sp) -> ({'tree': n, 'model': m}, the tree
    region's launches by op name). tree_ops: the bookkeeping implementation ('reference' / 'triton'; None:
    the engine's own choice)."""
    import triton.runtime.interpreter as interp

    runner = llm.engine.runner
    if tree_ops is not None:
        from m3eagle.engine import step_ops
        from m3eagle.engine import tree_ops as tree_ops_mod

        book, tops = step_ops.create(tree_ops), tree_ops_mod.create(tree_ops)
        runner._step_ops = lambda meta: book
        runner._tree_ops = lambda meta: tops
    last: list[LaunchCounter] = []
    orig_execute = runner.execute
    saved = {}
    for owner, names in ((runner.target, ("forward", "compute_logits", "greedy_ids")),
                         (runner.draft, ("forward", "compute_logits"))):
        for n in names:
            saved[(owner, n)] = getattr(owner, n)

    def execute(inp):
        if not bool((inp.row_num_drafts > 0).all()):
            return orig_execute(inp)
        counter = LaunchCounter()
        for (owner, n), fn in saved.items():
            setattr(owner, n, counter.model_region(fn, head=owner is runner.draft and n == "forward"))
        run = interp.InterpretedFunction.run

        def counted(self, *a, **k):
            counter.add(self.fn.__name__)
            counter.in_triton = True  # the interpreter's own host copies are not launches
            try:
                return run(self, *a, **k)
            finally:
                counter.in_triton = False

        interp.InterpretedFunction.run = counted
        try:
            with counter:
                out = orig_execute(inp)
        finally:
            interp.InterpretedFunction.run = run
            for (owner, n), fn in saved.items():
                setattr(owner, n, fn)
        last[:] = [counter]
        return out

    runner.execute = execute
    try:
        llm.generate(prompts, sp)
    finally:
        runner.execute = orig_execute
    if not last:
        raise RuntimeError("no decode-only tree step ran: raise max_tokens")
    return last[0].counts, dict(sorted(last[0].names.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", default="3,4,16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tree-ops", default="triton", choices=["reference", "triton"])
    ap.add_argument("--narrow", action="store_true", help="every step narrow (tree_max_batch=0)")
    ap.add_argument("--names", action="store_true", help="the tree region's launches by op name")
    args = ap.parse_args()
    llm = LLM(device="cpu", draft_tree=args.tree, max_model_len=256, graph_shapes=True,
              **({"tree_max_batch": 0} if args.narrow else {}))
    prompts = [list(llm.engine.tokenizer.encode(f"def f{i}(x):\n    return")) for i in range(args.batch)]
    counts, names = count_tree_step(llm, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                    args.tree_ops)
    out: dict[str, Any] = {"tree": args.tree, "batch": args.batch, "tree_ops": args.tree_ops, "narrow": args.narrow,
                           **counts}
    if args.names:
        out["names"] = names
    print(json.dumps(out))


if __name__ == "__main__":
    main()
