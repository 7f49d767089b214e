"""The engine loop in one background thread, handing results to asyncio.

Threading model:
- the engine thread is the only caller of `LLMEngine.step()`. It sleeps on an event while the engine
  has nothing to do and wakes when a request is added or aborted;
- the asyncio thread (uvicorn's event loop) adds requests (`LLMEngine.add_request` only queues them in
  the engine's intake, it never waits for a step) and aborts them (`LLMEngine.abort` is immediate when
  no step runs, else applied by the running step before it returns, so pages are freed at once);
- after each step the engine thread hands the step's deltas to the asyncio thread in one
  `call_soon_threadsafe`; there each delta goes to its request's asyncio.Queue and to the metrics. All
  bookkeeping of requests in flight (`_streams`) lives on the asyncio thread: no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from m3eagle.engine.llm_engine import LLMEngine, SpecCounters
from m3eagle.engine.request import RequestDelta
from m3eagle.engine.warmup import WarmupStopped
from m3eagle.entrypoints.server.metrics import PrefixCacheCounts, RequestTimes, ServerMetrics
from m3eagle.sampling.params import SamplingParams

log = logging.getLogger("m3eagle")

PR_SET_NAME = 15  # prctl(2): names the calling thread


def name_os_thread(name: str) -> bool:
    """Give the calling thread `name` in the OS too (Linux: the first 15 bytes), so `top -H`, py-spy and
    /proc/<pid>/task/*/comm tell the engine thread from the event loop when the process is CPU-bound. Python's
    thread names stay inside Python. False where the OS call is not available (the name is cosmetic)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def freeze_startup_objects() -> int:
    """Collect once, then move every object alive now -- the model, the engine, the captured graphs, the
    libraries -- out of the garbage collector's reach (gc.freeze, as vLLM and SGLang do after startup), so a
    full collection while serving walks only what requests made: a collection of the whole startup heap stalls
    the GIL, and with it both the engine thread and the event loop, for tens of milliseconds. Returns the
    number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


MAX_CONSECUTIVE_FAULTS = 3  # a step that keeps failing after rollback fails its requests instead of spinning


@dataclass
class RequestStream:
    """One request in flight, as the HTTP side sees it."""

    request_id: str
    num_prompt_tokens: int
    queue: asyncio.Queue[RequestDelta] = field(default_factory=asyncio.Queue)
    times: RequestTimes = field(default_factory=lambda: RequestTimes(time.monotonic()))
    detached: bool = False  # the client went away: deltas are dropped (metrics still count them)


# How long a server stopped during its warm-up waits for the engine thread to finish its current warm-up item.
WARMUP_STOP_S = 120.0


class AsyncEngine:
    """`warmup`: the engine thread first runs `LLMEngine.warmup` (graph captures, Triton compiles, every
    sampling path), then serves; `warmed` is set once it has, `warmup_error` holds why it could not."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, warmup: bool = False):
        self.engine, self.metrics = engine, metrics
        self._warmup = warmup
        self.warmed = threading.Event()
        self.warmup_error: str | None = None
        self.warmup_info: dict | None = None
        self._streams: dict[str, RequestStream] = {}  # asyncio thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; results go to the running event loop (call from it)."""
        if self.engine.owner is not None:  # two stepping threads would take each other's outputs
            raise RuntimeError(f"this engine is already stepped by {self.engine.owner}: one server per LLM "
                               "(build another LLM for a second server)")
        self._loop = asyncio.get_running_loop()
        if not self._warmup:  # ready as soon as it listens (set here: a request may come before the thread runs)
            self.warmed.set()
        self.engine.owner = "the OpenAI server's engine thread"  # LLM.generate refuses until the thread ends
        self._thread = threading.Thread(target=self._run, name="m3eagle-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is still in flight, let the engine thread free its pages, and stop it."""
        for rid in list(self._streams):
            self.abort(rid)
        if self.warmed.is_set():  # anything added around the HTTP side (while warming: the warm-up's own requests)
            for rid in self.engine.request_ids():
                self.engine.abort(rid)
        self._wake.set()
        t_end = time.monotonic() + timeout
        while self._streams and time.monotonic() < t_end and self.alive:  # the abort deltas come back
            await asyncio.sleep(0.01)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            # A thread still warming up ends after its current item (a graph capture or a prompt batch, which may
            # compile for tens of seconds): wait for it, since a process that exits under a running compile or
            # capture is aborted by the C++ runtime instead of exiting cleanly.
            wait = max(0.0, t_end - time.monotonic()) if self.warmed.is_set() else max(timeout, WARMUP_STOP_S)
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, wait)

    # ---- requests (asyncio thread) ------------------------------------------------------------
    def add(self, prompt_ids: list[int], params: SamplingParams, prompt: str | None, prefix: str,
            stream_text: bool = True, queue: asyncio.Queue[RequestDelta] | None = None) -> RequestStream:
        """Queue a request; raises RequestError (the engine's validation) before anything is queued.
        stream_text: see LLMEngine.add_request (False when only the finished output is read). queue: where its
        deltas go (several requests of one HTTP call -- a list of prompts -- share one); none: its own."""
        rid = f"{prefix}-{uuid.uuid4().hex}"
        stream = RequestStream(rid, len(prompt_ids)) if queue is None else RequestStream(rid, len(prompt_ids), queue)
        self._streams[rid] = stream  # before the engine can produce a delta for it
        try:
            self.engine.add_request(prompt_ids, params, prompt, request_id=rid, stream_text=stream_text)
        except BaseException:
            del self._streams[rid]
            raise
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """The client is gone: stop queueing its deltas and abort it in the engine (pages freed at once, or
        by the step running now)."""
        s = self._streams.get(request_id)
        if s is not None:
            s.detached = True
        self.engine.abort(request_id)
        self._wake.set()

    def abort_all(self) -> int:
        """Abort every request in flight (shutdown past its timeout) *without* detaching it: each one's final
        "abort" delta still reaches its handler, which answers 503 / ends its stream with an error event.
        Returns how many there were."""
        rids = list(self._streams)
        for rid in rids:
            self.engine.abort(rid)
        self._wake.set()
        return len(rids)

    def _dispatch(self, deltas: list[RequestDelta], spec: SpecCounters, cache: PrefixCacheCounts,
                  now: float) -> None:
        """On the asyncio thread: one step's deltas to their queues and to the metrics."""
        self.metrics.observe_spec(spec)
        self.metrics.observe_prefix_cache(cache)
        for d in deltas:
            s = self._streams.get(d.request_id)
            if s is None:
                continue
            self.metrics.observe(s.times, d, now)
            if d.finished:
                del self._streams[d.request_id]
            if not s.detached:
                s.queue.put_nowait(d)

    # ---- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        name_os_thread("m3eagle-engine")
        try:
            if eng.device.type == "cuda" and eng.device.index is not None:  # the current device is per thread
                torch.cuda.set_device(eng.device)
            if self._warmup:
                try:
                    self.warmup_info = eng.warmup(should_stop=self._stop.is_set)
                except WarmupStopped:  # the server is stopping: end here, between two warm-up items
                    log.info("warm-up stopped: the server is shutting down")
                    self.warmup_error = "stopped during the warm-up"
                    return
                except Exception as e:  # the server cannot promise its latency: it reports and stops
                    log.exception("warm-up failed")
                    self.warmup_error = f"{type(e).__name__}: {e}"
                    return
                # The warm-up's dummy prompts are not counted: the engine restarted its prefix-cache totals.
                with contextlib.suppress(RuntimeError):  # the event loop closed meanwhile (shutdown)
                    self._loop.call_soon_threadsafe(self.metrics.rebase_prefix_cache, PrefixCacheCounts.of(eng))
            frozen = freeze_startup_objects()
            log.debug("froze %d startup objects out of the garbage collector's reach", frozen)
            self.warmed.set()
            self._loop_steps()
        finally:
            gc.unfreeze()  # a stopped server's objects may be garbage now (tests run many servers in one process)
            self.engine.owner = None

    def _loop_steps(self) -> None:
        eng, faults = self.engine, 0
        while not self._stop.is_set():
            if not (eng.has_work() or eng.has_output()):
                # No wake-up is lost: add/abort set the event after queueing, and the loop re-checks
                # has_work() after clearing it.
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                deltas = eng.step()
                faults = 0
            except Exception as e:  # the engine rolled back to host truth; its requests will be recomputed
                faults += 1
                log.exception("engine step failed (%d in a row)", faults)
                if faults >= MAX_CONSECUTIVE_FAULTS:
                    for rid in eng.request_ids():
                        eng.abort(rid, error=f"the engine failed {faults} steps in a row: {type(e).__name__}: {e}")
                    faults = 0
                continue
            now = time.monotonic()
            if self._loop is not None and not self._loop.is_closed():
                try:
                    self._loop.call_soon_threadsafe(self._dispatch, deltas, eng.counters.snapshot(),
                                                    PrefixCacheCounts.of(eng), now)
                except RuntimeError:  # the event loop closed under us (shutdown)
                    break
