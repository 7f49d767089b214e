"""Tensor-parallel ranks: starting them, the per-step broadcast, faults and shutdown.

    rank 0 (LLM, scheduler)                          ranks 1..N-1 (workers)
    ScheduledBatch -> StepInput in StepBuffers       waiting for a header
    header [cmd, host ints]  ──── broadcast ────►    (gloo "control" group: host ints, no device sync)
    step buffers (int/float/bool) ─ broadcast ─►     the same buffers -> input_builder.carve -> same StepInput
    execute: all-reduce / all-gather  ◄────────►     execute (same kernels, its own shard)

Each rank derives the same tokens without a broadcast of outputs: logits are all-gathered, and sampling is
counter-based on (seed, position), so every rank draws the same tokens and fills the same slot buffers.

Two ways to start a group:
- `LLM(..., tensor_parallel_size=N)`: rank 0 spawns N-1 workers with torch.multiprocessing (rendezvous on
  a free local TCP port); each builds the same LLM on its own device and serves steps until rank 0 stops it.
- torchrun (one process per GPU, one host or several): every process runs the user's script; RANK /
  WORLD_SIZE / MASTER_ADDR / MASTER_PORT come from the environment (env:// rendezvous). Rank 0's `LLM()`
  returns; the other ranks serve inside their `LLM()` and exit the process when rank 0 shuts down.

Faults: data collectives time out after M3EAGLE_TP_TIMEOUT seconds (default 300). A worker waiting for the
next step waits on the control group, whose timeout is long (an idle server is not a fault), but it exits
when rank 0 goes away (the gloo connection closes, and a watchdog sees its parent die). Rank 0 checks its
workers before every step; a collective that fails because a worker died raises `WorkerError` naming the
rank and its exit code, and the remaining workers are shut down.
NOTE: torch.distributed holds one default process group per process, so one tensor-parallel LLM lives in a
process at a time (`LLM.shutdown()` frees it).
"""

from __future__ import annotations

import copy
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from m3eagle.distributed.parallel_state import TPGroup

log = logging.getLogger("m3eagle")

STEP, CAPTURE, STOP, PLAIN_ENGINE = 1, 2, 3, 4
# [cmd, engine, rows, tokens, max_q, max_kv, any_random, want_logprobs, bucket (-1: none)]; engine 0 is the LLM's,
# 1.. the spec-off engines over the same weights that LLM.plain_engine() adds (the bench's baseline).
HEADER_LEN = 9
LEAVE_TIMEOUT_S = 20.0  # the most a shutdown waits for the process group's teardown
IDLE_TIMEOUT = timedelta(days=365)  # workers wait this long for the next step; their parent's life bounds it


def timeout_s() -> float:
    return float(os.environ.get("M3EAGLE_TP_TIMEOUT", "300"))


class WorkerError(RuntimeError):
    """A tensor-parallel rank failed; the group is down and this LLM cannot run steps any more."""


# ---- starting ---------------------------------------------------------------------------------------


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when this process was started by torchrun (or any env:// launcher)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank = int(os.environ["RANK"])
    return rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank))


def rank_device(device: torch.device, local_rank: int, size: int) -> torch.device:
    """The device of one rank: cuda:<local rank> on GPUs (so `device` must not name an index), the CPU else."""
    if device.type != "cuda":
        return device
    if device.index is not None and size > 1:
        raise ValueError(f"device={str(device)!r} with tensor_parallel_size={size}: pass device='cuda'; rank r "
                         "runs on cuda:<local rank r> (use CUDA_VISIBLE_DEVICES to choose the GPUs)")
    n = torch.cuda.device_count()
    if local_rank >= n:
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs on this host but torch sees {n}; lower "
                         "tensor_parallel_size or set CUDA_VISIBLE_DEVICES")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_group(rank: int, size: int, init_method: str, device: torch.device, deterministic: bool = False) -> TPGroup:
    """Join the process group: NCCL on GPUs, gloo on the CPU, plus a gloo control group for step headers.
    `deterministic`: the group sums partials in rank order (TPGroup.all_reduce), the deterministic mode's TP part."""
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel LLM already lives in this process (torch.distributed holds one "
                           "default process group per process): call its shutdown() first")
    backend = "nccl" if device.type == "cuda" else "gloo"
    extra = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s()), **extra)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TPGroup(rank=rank, size=size, group=dist.group.WORLD, control=control, deterministic=deterministic)


def free_tcp_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class Workers:
    """The N-1 worker processes rank 0 spawned (torch.multiprocessing, 'spawn'): each builds `build(**kwargs,
    _worker=...)` -- rank 0's own class (runtime.Runtime or a subclass), passed by reference so this module
    imports none of them -- as rank r, which serves steps until stopped."""

    def __init__(self, size: int, init_method: str, build: Callable[..., Any], llm_kwargs: dict[str, Any]):
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_worker_main, args=(r, size, init_method, build, llm_kwargs, os.getpid()),
                                  name=f"m3eagle-tp-rank{r}", daemon=True) for r in range(1, size)]
        for p in self.procs:
            p.start()

    def dead(self) -> list[tuple[int, int]]:
        """(rank, exit code) of every worker that has exited."""
        return [(r, p.exitcode) for r, p in enumerate(self.procs, 1) if p.exitcode is not None]

    def stop(self, wait_s: float) -> None:
        """Join for up to `wait_s` seconds, then terminate (and finally kill) whatever still runs."""
        end = time.monotonic() + wait_s
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


def _worker_main(rank: int, size: int, init_method: str, build: Callable[..., Any], llm_kwargs: dict[str, Any],
                 parent: int) -> None:
    """A spawned worker: watch the parent, build this rank's LLM, which serves until rank 0 says stop."""
    _watch_parent(parent)
    if str(llm_kwargs.get("device") or "").startswith("cpu"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))  # the ranks share the host's cores
    try:
        build(**llm_kwargs, _worker=(rank, size, init_method))
    except BaseException:
        print(f"m3eagle: tensor-parallel worker rank {rank} failed:\n{traceback.format_exc()}", flush=True)
        os._exit(1)
    # STOP received. Exit now, without interpreter teardown: destructors of live NCCL communicators and CUDA
    # graphs can block at exit (seen on 2 x H200: rank 0 waited out its join and had to terminate the worker).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _watch_parent(parent: int) -> None:
    """Exit when the parent process is gone, whatever this rank is blocked in (no rank outlives rank 0)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="m3eagle-parent-watch", daemon=True).start()


# ---- the step broadcast -------------------------------------------------------------------------------


def _mode_bits(mode: tuple[bool, ...]) -> int:
    """(any_random, want_logprobs, penalties, want_prompt_logprobs) as bits 0-3 of one header int."""
    return sum(int(b) << i for i, b in enumerate(mode))


def _broadcast_buffers(bufs: Any, rows: int, tokens: int, max_q: int, tp: TPGroup, penalties: bool = False,
                       n_stop: int = 0) -> None:
    """Rank 0's step values, packed in its StepBuffers, into every rank's StepBuffers (in place): the step's
    span of the byte buffer, one broadcast."""
    dist.broadcast(bufs.shape((rows, tokens, max_q, bufs.table_width, penalties, n_stop)).d_span, 0, group=tp.group)


class Driver:
    """Rank 0's side: tells the workers what each step runs, and turns a worker's death into WorkerError.
    One Driver per engine (`new_engine`); they share the group's state (workers, error)."""

    def __init__(self, tp: TPGroup, workers: Workers | None):
        self.tp, self.workers = tp, workers
        self.header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        self.engine_id, self._engines = 0, [0]  # _engines: a shared counter (a list, so that copies share it)
        self._error: list[str | None] = [None]
        self._stopping = [False]  # shared by copies: set before a shutdown stops the workers on purpose
        self._runners: list[Any] = []  # every engine's GraphRunner on rank 0 (shared by copies): see shutdown
        if workers is not None and tp.group is not None and dist.get_backend(tp.group) == "nccl":
            threading.Thread(target=self._monitor, name="m3eagle-tp-monitor", daemon=True).start()

    def _monitor(self) -> None:
        """NCCL only: a dead peer does not fail a collective, rank 0 would wait in it for the whole timeout.
        So watch the workers and abort the communicators on a death; the blocked step then returns and the
        next one raises WorkerError. (gloo fails the collective itself when the peer's socket closes.)
        NOTE: not exercised by the CPU tests."""
        while self.error is None and not self._stopping[0]:
            if (dead := self.workers.dead()) and not self._stopping[0]:
                self.error = self._dead_message(dead)
                log.error(self.error)
                abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
                try:
                    if abort is not None:
                        abort()
                except Exception as e:
                    log.warning("tensor-parallel monitor: aborting the process group failed (%s)", e)
                self.workers.stop(wait_s=1.0)
                return
            time.sleep(1.0)

    @property
    def error(self) -> str | None:
        return self._error[0]

    @error.setter
    def error(self, msg: str | None) -> None:
        self._error[0] = msg

    def _send(self, cmd: int, *ints: int) -> None:
        self.check()
        vals = [cmd, self.engine_id, *ints]
        self.header[: len(vals)] = torch.tensor(vals, dtype=torch.int64)
        dist.broadcast(self.header, 0, group=self.tp.control)

    def step(self, inp: Any, bucket: int | None, bufs: Any) -> None:
        """Broadcast the header and the step's buffers; the workers then run it as rank 0 does."""
        mode = (inp.any_random, inp.want_logprobs, inp.penalties is not None, inp.want_prompt_logprobs)
        n_stop = inp.penalties.stop_ids.shape[0] if inp.penalties is not None else 0
        self._send(STEP, inp.num_rows, inp.num_tokens, inp.meta.max_q, inp.meta.max_kv, _mode_bits(mode), n_stop,
                   -1 if bucket is None else bucket)
        _broadcast_buffers(bufs, inp.num_rows, inp.num_tokens, inp.meta.max_q, self.tp, mode[2], n_stop)

    def capture(self, bucket: int, mode: tuple[bool, ...]) -> None:
        """mode: the graph key's (any_random, want_logprobs, penalties, masked); never masked here (structured
        output is refused under tensor parallelism: the masks are not broadcast)."""
        if len(mode) > 3 and mode[3]:
            raise ValueError("a constrained (masked) graph under tensor parallelism: its masks are not broadcast")
        self._send(CAPTURE, 0, 0, 0, 0, _mode_bits((*mode[:3], False)), 0, bucket)

    def new_engine(self) -> Driver:
        """Tell the workers to build a spec-off engine over the same weights; its steps go through the
        Driver returned."""
        self._send(PLAIN_ENGINE)
        self._engines[0] += 1
        child = copy.copy(self)
        child.engine_id = self._engines[0]
        return child

    def attach(self, runner: Any) -> None:
        """A GraphRunner stepping through this group: its graphs are released before the group is left."""
        self._runners.append(runner)

    def check(self) -> None:
        if self.error is None and self.workers is not None and (dead := self.workers.dead()):
            self._fail(dead)
        if self.error is not None:
            raise WorkerError(self.error)

    @staticmethod
    def _dead_message(dead: list[tuple[int, int]]) -> str:
        who = ", ".join(f"rank {r} (exit code {c})" for r, c in dead)
        return (f"tensor-parallel worker {who} died; the group is shut down and this LLM cannot run any more "
                "steps: build a new LLM (the worker's traceback, if any, is on stderr)")

    def _fail(self, dead: list[tuple[int, int]]) -> None:
        self.error = self._dead_message(dead)
        log.error(self.error)
        self.shutdown(send_stop=False)

    @contextmanager
    def guard(self):
        """Around a step's (or a capture's) collectives. A failure because a worker died raises WorkerError
        naming it. Any other fault on rank 0 mid-step (an exception, Ctrl-C) leaves the workers inside a
        collective rank 0 will never join: the ranks are out of step, so the group is shut down too, and the
        fault propagates (later calls raise WorkerError). Unlike one process, the engine cannot roll back."""
        try:
            yield
        except WorkerError:
            raise
        except BaseException as e:
            if isinstance(e, Exception) and self.workers is not None:
                end = time.monotonic() + 2.0  # a peer's socket closes a moment before its exit code is in
                while not (dead := self.workers.dead()) and time.monotonic() < end:
                    time.sleep(0.05)
                if dead:
                    self._fail(dead)
                    raise WorkerError(self.error) from e
            self.error = (f"a step failed on rank 0 ({type(e).__name__}: {e}); the ranks are no longer in step, "
                          "so the tensor-parallel group was shut down: build a new LLM")
            log.error(self.error)
            self.shutdown(send_stop=False)
            raise

    def shutdown(self, send_stop: bool = True) -> None:
        """Stop the workers (a STOP header, then join / terminate) and leave the process group."""
        self._stopping[0] = True  # the monitor must not take the workers' exit for a fault (and abort NCCL)
        if self.workers is not None and len(self.workers.dead()) == len(self.workers.procs):
            send_stop = False  # nobody left to tell (terminated at interpreter exit, say)
        stopped = False
        if send_stop and self.error is None:
            try:
                self.header.zero_()
                self.header[0] = STOP
                dist.broadcast(self.header, 0, group=self.tp.control)
                stopped = True
            except Exception as e:  # a worker already gone: terminate below
                log.warning("tensor-parallel shutdown: stop broadcast failed (%s)", e)
        left = True
        if stopped:
            # The workers release theirs on STOP (serve). Only on this clean path: after a fault a captured
            # collective may never finish, and waiting for the device would hang the shutdown.
            release_graphs(self._runners)
            # Every rank leaves the group at the same time, then rank 0 joins the workers. Tearing NCCL down is
            # collective once CUDA graphs hold its communicator: a worker blocks in destroy_process_group until
            # rank 0 destroys too, so joining the worker first deadlocked (2 x H200: the join ran out, the worker
            # was terminated, and rank 0's own destroy then waited on a dead peer past the run's time limit).
            left = leave_group(LEAVE_TIMEOUT_S)
        if self.workers is not None:
            self.workers.stop(wait_s=10.0 if send_stop else 1.0)
        if left:
            leave_group(LEAVE_TIMEOUT_S)
        self.error = self.error or "this LLM was shut down (LLM.shutdown()); build a new one to generate"


def release_graphs(runners: list[Any]) -> None:
    """Destroy every captured CUDA graph of these GraphRunners: NCCL cannot tear a communicator down while a
    live graph holds one of its collectives (GraphRunner.release)."""
    for r in runners:
        try:
            r.release()
        except Exception as e:  # a broken device: the teardown below is bounded by its timeout anyway
            log.warning("tensor-parallel shutdown: releasing CUDA graphs failed (%s)", e)


def leave_group(timeout_s: float | None = None) -> bool:
    """Destroy the process group; True when it is gone. With timeout_s, the teardown runs in a daemon thread
    and is abandoned after that long (logged; False): a communicator whose peer is stuck or dead can block
    NCCL's teardown indefinitely, and shutting down must not hang the process with it."""
    if not dist.is_initialized():
        return True

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception as e:  # a group broken by a dead peer may not tear down cleanly; it is gone either way
            log.debug("destroy_process_group: %s", e)

    if timeout_s is None:
        destroy()
        return True
    t = threading.Thread(target=destroy, name="m3eagle-tp-teardown", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        log.warning("tensor-parallel shutdown: the process group did not tear down within %.0f s; abandoning "
                    "it (a new tensor-parallel LLM in this process may fail to start)", timeout_s)
        return False
    return True


# ---- the worker loop ----------------------------------------------------------------------------------


def serve(engine: Any, plain_engine: Callable[[], Any]) -> None:
    """A worker's life: run what rank 0 broadcasts -- steps (into this rank's buffers, carved into the same
    StepInput), CUDA-graph captures, new spec-off engines (`plain_engine()`) -- until STOP. Outputs stay on
    the device: rank 0 alone reads them."""
    from m3eagle.engine.input_builder import carve

    engines, tp = [engine], engine.tp
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    while True:
        dist.broadcast(header, 0, group=tp.control)
        cmd, eid, rows, tokens, max_q, max_kv, bits, n_stop, bucket = header.tolist()
        mode, bucket = tuple(bool(bits >> i & 1) for i in range(4)), (bucket if bucket >= 0 else None)
        if cmd == STOP:
            release_graphs([e.graphs for e in engines])  # before leaving the group, as rank 0 does
            return
        if cmd == PLAIN_ENGINE:
            engines.append(plain_engine())
            continue
        eng = engines[eid]
        if cmd == CAPTURE:
            eng.graphs.capture(bucket, (*mode[:3], False))
            continue
        _broadcast_buffers(eng.buffers, rows, tokens, max_q, tp, mode[2], n_stop)
        inp = carve(eng.buffers, rows, tokens, max_q, max_kv, eng.cfg.page_size, eng.ops, mode, n_stop)
        eng.graphs.run(inp, bucket)
