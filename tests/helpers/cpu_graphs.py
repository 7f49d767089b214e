"""A CPU stand-in of CUDA-graph capture and replay, closer to a replay than eager bucketed steps are.

`graph_shapes=True` on CPU runs every bucketed step eagerly on its own StepInput: the step's host ints (rows,
tokens, bounds, mode, a draft tree's verify width) come from its real rows. A captured graph instead bakes in
the host ints of the step it was captured on -- padding rows only (`GraphRunner.padding_input`) -- and every
replay recomputes them over whatever the step buffers hold. `cpu_replays(llm)` makes the engine's GraphRunner
"capture" that padding-only StepInput (running it twice, as the capture's warm-up does) and "replay" it over
each real step's buffers (the StepInputs of one bucket are views of the same buffer offsets), and checks at
every replay that the real step's host ints equal the captured ones: a host value a capture would bake in
wrongly fails here, on CPU.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from m3eagle import LLM
from m3eagle.engine.input_builder import StepInput
from m3eagle.engine.model_runner import ModelRunner, StepOutput


def host_ints(runner: ModelRunner, inp: StepInput) -> tuple:
    """Everything of a step input that execute() reads on the host: a graph's capture fixes all of it."""
    meta = inp.meta
    return (inp.num_rows, inp.num_tokens, meta.num_rows, meta.max_q, meta.max_kv, meta.page_size, inp.mode,
            inp.want_prompt_logprobs, inp.grammar is None, runner.step_width(inp))


class _Graph:
    """The captured StepInput; replay() runs execute() on it, reading the buffers as they are now."""

    def __init__(self, runner: ModelRunner, inp: StepInput):
        self.runner, self.inp = runner, inp
        self.out: StepOutput | None = None

    def replay(self) -> None:
        self.out = self.runner.execute(self.inp)


class _Static:
    """The graph's output tensors as GraphRunner reads them after a replay."""

    def __init__(self, graph: _Graph):
        self.graph = graph

    def fresh(self) -> StepOutput:
        return self.graph.out.fresh()


def cpu_replays(llm: LLM) -> Counter:
    """Turn `llm`'s bucketed steps into CPU replays of padding-only captures; returns the replay count per
    bucket key (filled as the engine steps). Needs graph_shapes=True (buckets at all)."""
    gr, runner = llm.engine.graphs, llm.engine.runner
    assert llm.engine.graph_shapes, "cpu_replays needs graph_shapes=True"
    replays: Counter = Counter()

    def capture(bucket: Any, mode: tuple[bool, ...]) -> None:
        graph = _Graph(runner, gr.padding_input(bucket, mode))
        for _ in range(2):  # the capture's eager warm-up runs
            graph.replay()
        gr.graphs[(bucket, mode)] = (graph, _Static(graph))

    real_run = gr._run

    def run(inp: StepInput, bucket: Any) -> StepOutput:
        if bucket is not None:
            graph = gr.graphs[(bucket, inp.mode)][0]
            want, got = host_ints(runner, graph.inp), host_ints(runner, inp)
            assert got == want, f"bucket {bucket}: the step's host ints {got} differ from its capture's {want}"
            replays[bucket] += 1
        return real_run(inp, bucket)

    gr._capture, gr._run, gr.use_graphs = capture, run, True
    return replays
