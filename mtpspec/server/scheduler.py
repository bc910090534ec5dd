"""One worker thread per served model runs its batched Engine; HTTP handlers talk to it through queues.

The event loop never touches a model. A request is `submit`ted (or refused at once: QueueFull, the
client's 429) and joins the running batch between two engine steps; each step's new tokens go back
to the request's asyncio queue as a `Chunk`, and its end as a `Finished`. `cancel` (a stop string
seen, a client gone) frees the sequence's slot before the next step. The verify page's work runs on
the same thread between steps (`run_job`), so nothing needs a lock and nothing waits behind one.
"""

from __future__ import annotations

import asyncio
import queue
import secrets
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from time import perf_counter
from typing import Callable

import torch

from ..adaptive import ByBatchSize
from ..api import Model
from ..drafters import make_drafter
from ..engine import Engine, Sequence, TokenLogprob
from ..sampling import Sampler, SamplingParams
from ..threads import apply_threads
from ..types import GenerationResult
from .metrics import ServerMetrics

AUTO_K_MAX = 8  # the deepest draft `--k auto` may choose


class QueueFull(Exception):
    """--max-queue requests already wait for a slot (every slot taken): the client should retry later (429)."""


@dataclass(frozen=True)
class GenRequest:
    prompt: list[int]  # token ids, BOS first where the tokenizer has one
    params: SamplingParams
    max_tokens: int
    seed: int | None = None  # None: a fresh random seed
    stop_ids: tuple[int, ...] = ()  # besides the tokenizer's end-of-text ids
    logprobs: int | None = None  # None: no log-probs; n: each token's and the n most likely


@dataclass(frozen=True)
class Chunk:
    tokens: list[int]  # what one engine step emitted for this request
    logprobs: list[TokenLogprob]  # one per token when asked, else empty


@dataclass(frozen=True)
class Finished:
    reason: str  # stop | length | context | cancelled
    result: GenerationResult


@dataclass(frozen=True)
class Failed:
    message: str


@dataclass
class Handle:
    """The HTTP side of one request: its event queue (Chunk*, then Finished or Failed) and cancel()."""

    scheduler: "Scheduler"
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    submitted: float = field(default_factory=perf_counter)
    sid: int | None = None  # the engine's id, set on the worker thread
    last_emit: float | None = None

    def post(self, event) -> None:  # from the worker thread
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the request's event loop has closed (server shutting down): nobody is listening
            pass

    def cancel(self) -> None:
        self.scheduler.inbox.put(("cancel", self))


@dataclass(frozen=True)
class Speculation:
    """What the server drafts with for one model: a drafter name, its draft object, k (or auto), the drafter's options."""

    drafter: str
    draft_model: object
    k: int | str
    options: tuple[tuple[str, object], ...] = ()  # keywords of make_drafter (mtp_lookup)

    def describe(self) -> dict:
        return {"drafter": self.drafter, "k": self.k, **dict(self.options)}


class Scheduler:
    """A served model's engine on its own thread: continuous batching of every request to this model."""

    def __init__(self, name: str, model: Model, spec: Speculation, max_batch: int, max_queue: int,
                 prefill_chunk: int, metrics: ServerMetrics) -> None:
        self.name, self.model, self.spec, self.metrics = name, model, spec, metrics
        self.max_queue = max_queue
        self.k = AUTO_K_MAX if spec.k == "auto" else spec.k
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.engine = self._new_engine()
        self.inbox: queue.Queue = queue.Queue()
        self.handles: dict[int, Handle] = {}
        self.seqs: dict[int, Sequence] = {}
        self._admitted = 0  # requests submitted and not yet answered (Finished or Failed posted): slots + queue
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"mtpspec-engine-{name}", daemon=True)
        self._thread.start()

    # ---- the event loop's side

    def queue_length(self) -> int:
        """Requests waiting for a slot: those admitted beyond the --max-batch that have one (a request that joins
        a free slot, its prompt still prefilling, does not wait)."""
        return max(0, self._admitted - self.max_batch)

    def submit(self, req: GenRequest) -> Handle:
        """Queue a generation (QueueFull when every slot is taken and --max-queue requests already wait)."""
        with self._lock:
            if self._admitted >= self.max_batch + self.max_queue:
                raise QueueFull(f"{self.queue_length()} requests are waiting for model {self.name!r} (the server's --max-queue)")
            self._admitted += 1
        loop = asyncio.get_running_loop()
        handle = Handle(self, asyncio.Queue(), loop)
        self.inbox.put(("add", handle, req))
        return handle

    def run_job(self, fn: Callable[[], object]) -> Future:
        """fn() on the worker thread between two steps (the verify page's work); its result as a Future."""
        fut: Future = Future()
        self.inbox.put(("job", fn, fut))
        return fut

    def close(self) -> None:
        self.inbox.put(("stop",))
        self._thread.join(timeout=10)

    # ---- the worker thread

    def _new_engine(self) -> Engine:
        depth = ByBatchSize(k_max=AUTO_K_MAX) if self.spec.k == "auto" and self.spec.drafter != "none" else None
        return Engine(self.model.module, self.max_batch, exact=False, depth=depth, prefill_chunk=self.prefill_chunk)

    def _run(self) -> None:
        while True:
            try:
                items = [self.inbox.get(block=not self.engine.active)]
            except queue.Empty:
                items = []
            while True:
                try:
                    items.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            for item in items:
                if item[0] == "stop":
                    self._fail_all("the server is shutting down")
                    return
                self._handle(item)
            if self.engine.active:
                self._step()

    def _handle(self, item) -> None:
        kind = item[0]
        if kind == "add":
            _, handle, req = item
            try:
                self._add(handle, req)
            except Exception as e:  # checked by the HTTP layer first: this is a bug, reported to the one client
                self._answered(1)
                handle.post(Failed(f"{type(e).__name__}: {e}"))
        elif kind == "cancel":
            handle = item[1]
            if handle.sid is not None and handle.sid in self.handles:
                self.engine.cancel(handle.sid)
                self._collect()
        elif kind == "job":
            _, fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the awaiting request
                    fut.set_exception(e)

    def _add(self, handle: Handle, req: GenRequest) -> None:
        module = self.model.module
        drafter = make_drafter(self.spec.drafter, module, draft_model=self.spec.draft_model, **dict(self.spec.options))
        seed = secrets.randbits(63) if req.seed is None else req.seed
        stop = tuple(dict.fromkeys(tuple(self.model.tokenizer.stop_ids) + req.stop_ids))
        seq_box: list[Sequence] = []
        on_tokens = lambda toks: self._emit(handle, seq_box[0], toks)  # noqa: E731
        sid = self.engine.add(req.prompt, drafter, Sampler(req.params, seed), self.k, req.max_tokens, stop, on_tokens,
                              logprobs=req.logprobs)
        seq = self.engine.waiting[-1]
        seq_box.append(seq)
        handle.sid = sid
        self.handles[sid], self.seqs[sid] = handle, seq

    def _emit(self, handle: Handle, seq: Sequence, toks: list[int]) -> None:
        now = perf_counter()
        if handle.last_emit is None:
            self.metrics.ttft(now - handle.submitted)
        else:
            gap = (now - handle.last_emit) / len(toks)
            for _ in toks:
                self.metrics.itl(gap)
        handle.last_emit = now
        self.metrics.generated(len(toks))
        handle.post(Chunk(list(toks), list(seq.pending_logprobs)))

    def _answered(self, n: int) -> None:
        """n requests left the server's slots and queue (a client told of its end may send the next one at once)."""
        with self._lock:
            self._admitted -= n

    def _step(self) -> None:
        if self.model.threads and torch.get_num_threads() != self.model.threads:
            apply_threads(self.model.threads)
        try:
            rec = self.engine.step()
        except Exception as e:  # a bug: the requests in flight fail (500), a fresh engine serves the next ones
            self.engine = self._new_engine()  # first: a client told of the failure may send its next request at once
            self._fail_all(f"{type(e).__name__}: {e}")
            return
        if rec is not None:
            self.metrics.step(rec)
        self._collect()

    def _collect(self) -> None:
        """Hand every finished sequence's result to its request."""
        for sid in list(self.engine.finished):
            seq = self.engine.finished.pop(sid)
            handle = self.handles.pop(sid, None)
            self.seqs.pop(sid, None)
            if handle is not None:
                self._answered(1)
                handle.post(Finished(seq.finish_reason or "length", seq.result()))

    def _fail_all(self, message: str) -> None:
        """Every request in flight fails (the engine is replaced, or the server stops: it is not touched here, it may
        be the one that just raised)."""
        self._answered(len(self.handles))
        for handle in self.handles.values():
            handle.post(Failed(message))
        self.handles.clear()
        self.seqs.clear()
