"""Shared fixtures: tiny random MiniMax-M3 checkpoints written by transformers (the oracle)."""

from __future__ import annotations

import logging
import os
import sys

import numpy as np
import pytest
import torch

# Under pytest-xdist (the README's `-n 2`) each worker takes one core: two workers of two threads each would
# fight over the CI machine's two cores.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(scope="session", autouse=True)
def row_invariant_interpreter_dot():
    """The Triton interpreter's tl.dot is np.matmul, whose BLAS kernel (OpenBLAS picks one per CPU) may give a
    row other bits at another position in the block. The kernels' row-invariance tests (deterministic mode)
    then fail on some CPUs for the interpreter's sake, not the kernel's. Every float dot here runs numpy's own
    einsum loop instead (no BLAS; optimize=False keeps it off tensordot), which sums each output element's K
    products by one rule for every row, as fast as np.matmul at tile sizes. Patched after collection, once the
    test modules have set TRITON_INTERPRET and imported triton."""
    if "triton" not in sys.modules:
        yield
        return
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    original = InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        native = (np.float16, np.float32, np.float64)
        if a.data.dtype not in native or b.data.dtype not in native:  # fp8 / bf16 raw bits: triton's own path
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.dtype
        out = np.einsum("...mk,...kn->...mn", a.data.astype(acc), b.data.astype(acc), optimize=False)
        return TensorHandle(out + d.data, d.dtype.scalar)

    InterpreterBuilder.create_dot = create_dot
    yield
    InterpreterBuilder.create_dot = original


def _interpreter():
    """(triton.language, triton.runtime.interpreter) where this run may interpret kernels (a test module
    imported triton or set TRITON_INTERPRET), else (None, None)."""
    if "triton" not in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        return None, None
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return None, None
    return tl, interpreter


@pytest.fixture(scope="session", autouse=True)
def interpreter_np_dtypes_looked_up_once():
    """The interpreter maps a Triton type to its numpy dtype at every op by building a dict of every type
    (_get_np_dtype): ~7% of an interpreted kernel test's time. The mapping of each scalar type (a block's
    element type: what the original returns for the block too) is kept after its first lookup; pointers
    (unhashable) go to the original each time."""
    tl, interpreter = _interpreter()
    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None:
        yield
        return
    np_dtypes = {}

    def get_np_dtype(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        try:
            return np_dtypes[key]
        except (KeyError, TypeError):
            got = original(tt_dtype)
            try:
                np_dtypes[key] = got
            except TypeError:
                pass
            return got

    interpreter._get_np_dtype = get_np_dtype
    yield
    interpreter._get_np_dtype = original


@pytest.fixture(scope="session", autouse=True)
def interpreter_skips_the_unasserted_overflow_check():
    """The interpreter's semantic recomputes every int32 add / sub / mul in int64 and compares it with the
    type's range (sanitize_overflow, on by default), to feed a device_assert that does nothing unless the
    builder's debug option is on, which the interpreter's never is: a quarter of an interpreted kernel test's
    time (tests/kernels/test_moe_direct.py). The check is skipped while debug is off, as its assert is; with
    debug on it runs as before."""
    _, interpreter = _interpreter()
    semantic = getattr(interpreter, "interpreter_semantic", None)
    original = getattr(semantic, "binary_op_sanitize_overflow_impl", None)
    if original is None or not hasattr(semantic.builder, "options"):
        yield
        return

    def sanitize(lhs, rhs, binary_op):
        if getattr(semantic.builder.options, "debug", True):
            return original(lhs, rhs, binary_op)
        return None

    semantic.binary_op_sanitize_overflow_impl = sanitize
    yield
    del semantic.binary_op_sanitize_overflow_impl


@pytest.fixture(scope="session", autouse=True)
def interpreter_patches_language_once_per_launch():
    """The Triton interpreter patches triton.language (every builtin of tl, tl.core, tl.math and the tensor
    class, found by inspect.getmembers) at each launch, and again at each call of a @triton.jit helper inside
    the launch, which the launch's patch already covers: a quarter of an interpreted engine test's time went to
    those repeats. Here a helper's call skips the patch where the launch in progress already patched every
    language module the helper's globals see (tl.sum & co. see tl.core, which the launch's own patch may not
    cover: their first call patches it, as before); the launch's own patch and its restore run unchanged.
    Patched after collection, where a test module imported triton or set TRITON_INTERPRET (a module that
    launches kernels only through the package imports triton later)."""
    tl, interpreter = _interpreter()
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if scope_type is None or not hasattr(interpreter, "_patch_lang"):  # another interpreter design: leave it
        yield
        return
    original_patch, original_call = interpreter._patch_lang, interpreter.GridExecutor.__call__
    launches: list[set[int]] = []  # per launch in progress: the modules patched since it began

    def langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_lang(fn):
        seen = langs(fn)
        if launches and launches[-1] and seen <= launches[-1]:
            return scope_type()  # nothing patched, nothing to restore
        scope = original_patch(fn)
        if launches:
            launches[-1] |= seen
        return scope

    def call(self, *args, **kwargs):
        launches.append(set())
        try:
            return original_call(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter._patch_lang, interpreter.GridExecutor.__call__ = patch_lang, call
    yield
    interpreter._patch_lang, interpreter.GridExecutor.__call__ = original_patch, original_call


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """(directory, hf_model): 4 layers mixing dense/MoE and full/sparse, block 8, top-2 blocks."""
    from transformers.utils import logging as hf_logging

    from tests.helpers.hf_utils import random_hf_model, tiny_hf_config

    hf_logging.set_verbosity_error()
    cfg = tiny_hf_config(seed=0)
    model = random_hf_model(cfg, seed=0)
    d = tmp_path_factory.mktemp("tiny_m3")
    model.save_pretrained(d)
    return d, model


@pytest.fixture(scope="session")
def model_dir(tiny_model):
    """The tiny checkpoint's directory."""
    return tiny_model[0]


@pytest.fixture(scope="session")
def head_dir(model_dir, tmp_path_factory):
    """A random Eagle3 head (seed 0) on the tiny target: acceptance near zero, drafting path exercised."""
    from tests.helpers.spec_utils import random_head

    return random_head(model_dir, tmp_path_factory.mktemp("random_head"))


@pytest.fixture
def make_llm():
    """LLM factory; at teardown every engine it built must be idle with all pages free."""
    from m3eagle import LLM
    from tests.helpers.engine_utils import assert_clean

    made = []

    def make(model, **kw):
        kw = {"device": "cpu", "page_size": 4, "max_model_len": 128, **kw}
        llm = LLM(model, **kw)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert_clean(llm)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine: intra-op threads only add contention."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A CUDA test collected beside CPU test modules that set TRITON_INTERPRET would launch every Triton kernel
    under the interpreter on device tensors and fail for that reason alone: say so instead."""
    if (item.get_closest_marker("gpu") is not None and os.environ.get("TRITON_INTERPRET") == "1"
            and torch.cuda.is_available()):
        pytest.fail("TRITON_INTERPRET=1 was set by a CPU test module collected in this run; run the GPU test "
                    "files (tests/engine/*_gpu.py, test_cuda_graphs.py, test_long_context.py) in a pytest "
                    "process of their own", pytrace=False)


# The slowest tests of the CPU suite (seconds in the README's `-n 2` run, 2 cores), slowest first. Collected
# in file order they came late (tests/kernels/ sorts after tests/engine/), and a worker still running one of
# them while the other had nothing left set the suite's wall time. Run first, they overlap with everything
# else: xdist's load scheduling hands out the rest from one shared queue as workers free up. Only tests whose
# module-scoped fixtures no test left behind uses: moving one away from such a test would build them twice.
SLOW_FIRST = (
    "tests/kernels/test_kernels_compile.py::test_every_recorded_launch_compiles_for_sm90",  # ~80 s
    "tests/engine/test_deterministic.py::test_batch_invariant_kernels_engine_interpreted",  # ~23 s
    "tests/engine/test_tree_graphs.py::test_tree_on_triton_attention_equals_plain",  # ~9 s
    "tests/engine/test_tree_kernels.py::test_engine_on_tree_kernels_grows_the_reference_trees",  # 3 x ~6 s
    "tests/distributed/test_deterministic_reduce.py::test_fixed_order_all_reduce_over_three_gloo_ranks",  # ~6 s
    "tests/engine/test_deterministic_gpu.py::test_properties_logic_on_cpu",  # ~4 s
    "tests/kernels/test_batch_invariant.py::test_attention_token_invariant",  # ~4 s
    "tests/kernels/test_batch_invariant.py::test_prompt_kv_bytes_chunk_invariant",  # ~3 s
)
# Modules whose tests share an expensive module-scoped fixture, moved whole behind SLOW_FIRST: xdist's load
# scheduling first hands each worker a block of consecutive tests (a quarter of its share, ~240 tests), so one
# worker runs the module and builds the fixture once. At the end of the order its tests went out a few at a
# time to both workers, and each built it (the training pipeline, ~9 s).
WHOLE_MODULES_FIRST = ("tests/training/test_training.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Moves the SLOW_FIRST tests (every parametrization) to the front, in that order, then the tests of the
    WHOLE_MODULES_FIRST modules; the rest keep theirs."""
    first = SLOW_FIRST + WHOLE_MODULES_FIRST

    def rank(item: pytest.Item) -> int:
        name = item.nodeid.split("[", 1)[0]
        return next((i for i, key in enumerate(first) if name == key or name.startswith(key + "::")), len(first))

    items.sort(key=rank)  # stable
