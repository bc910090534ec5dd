"""One worker thread per served model runs its batched Engine; HTTP handlers talk to it through queues.

The event loop never touches a model. A request is `submit`ted (or refused at once: QueueFull, the
client's 429) and joins the running batch between two engine steps as its n sequences (choices), which
share one prefill of the prompt (Engine.add prefill_from); each step's new tokens go back to the
request's asyncio queue as a `Chunk` of one choice, and each choice's end as a `Finished`. `cancel` (a
stop string seen, a client gone) frees a choice's slot, or all of them, before the next step. Each
request drafts as it chose (RequestSpec: off, a fixed depth, or auto); the engine's depth policy
(PerRequest) gives every sequence of a batch its own. The verify page's work runs on the same thread
between steps (`run_job`), so nothing needs a lock and nothing waits behind one.
"""

from __future__ import annotations

import asyncio
import queue
import secrets
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from time import perf_counter
from typing import Callable

import torch

from ..adaptive import ByBatchSize
from ..api import Model
from ..drafters import make_drafter
from ..engine import Engine, Sequence, TokenLogprob
from ..models.compiled import AUTO_K_MAX, auto_depth, warm
from ..prefix import PrefixStore
from ..sampling import Sampler, SamplingParams
from ..threads import apply_threads
from ..types import BatchStep, GenerationResult
from .metrics import ServerMetrics

SEED_SPACE = 2**63  # a request's seed is in [0, SEED_SPACE)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with `seed` (n > 1): seed + index, wrapped into [0, 2**63) (vLLM's rule:
    choice i is the answer an n = 1 request with that seed would get)."""
    return (seed + index) % SEED_SPACE


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
    n: int = 1  # choices: sequences sharing one prefill of the prompt, choice i seeded with choice_seed(seed, i)
    speculation: int | str | None = None  # "off" | "auto" | a fixed depth D; None: the server's (RequestSpec)
    prompt_logprobs: int | None = None  # echo with logprobs: the prompt tokens' too (the first token has none)


@dataclass(frozen=True)
class Chunk:
    index: int  # the choice
    tokens: list[int]  # what one engine step emitted for this choice
    logprobs: list[TokenLogprob]  # one per token when asked, else empty
    prompt_logprobs: list[TokenLogprob] | None = None  # the choice's first chunk, with prompt_logprobs: prompt[1:]'s


@dataclass(frozen=True)
class Finished:
    index: int  # the choice
    reason: str  # stop | length | context | cancelled
    result: GenerationResult
    prompt_logprobs: list[TokenLogprob] | None = None  # with prompt_logprobs (a choice may end before any chunk)


@dataclass(frozen=True)
class Failed:
    message: str


@dataclass
class Handle:
    """The HTTP side of one request: its event queue (Chunk*, a Finished per choice, or one Failed) and cancel()."""

    scheduler: "Scheduler"
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    submitted: float = field(default_factory=perf_counter)
    sids: list[int] = field(default_factory=list)  # the engine's ids, choice by choice, set on the worker thread
    last_emit: dict[int, float] = field(default_factory=dict)  # choice -> when it last emitted

    def post(self, event) -> None:  # from the worker thread
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the request's event loop has closed (server shutting down): nobody is listening
            pass

    def cancel(self, index: int | None = None) -> None:
        """Stop choice `index` (a stop string seen in it), or every choice (None: the client is gone)."""
        self.scheduler.inbox.put(("cancel", self, index))


@dataclass(frozen=True)
class Speculation:
    """What the server drafts with for one model: a drafter name, its draft object, k (or auto), the drafter's options."""

    drafter: str
    draft_model: object
    k: int | str
    options: tuple[tuple[str, object], ...] = ()  # keywords of make_drafter (mtp_lookup)

    def describe(self) -> dict:
        return {"drafter": self.drafter, "k": self.k, **dict(self.options)}


@dataclass(frozen=True)
class RequestSpec:
    """What one request drafts with: the served drafter at depth k (a fixed D, or "auto": the cost model's choice per
    step), or nothing ("off": plain decoding, k = 0)."""

    spec: Speculation  # the server's (the drafter "none" when off)
    k: int | str

    @property
    def choice(self) -> int | str:
        """As a request names it: "off", "auto" or D."""
        return "off" if self.spec.drafter == "none" else self.k

    def describe(self) -> dict:
        if self.spec.drafter == "none":
            return {"drafter": "none", "k": 0, "speculation": "off"}
        return {**self.spec.describe(), "k": self.k, "speculation": self.k}


class PerRequest:
    """The engine's DepthPolicy when each request chose its speculation: a fixed-depth sequence drafts its k (as room
    allows), an "off" one nothing, and the "auto" ones what the cost model (`auto`, ByBatchSize) chooses. The cost model
    is asked about the whole batch (it prices the whole forward) and learns from every step it was asked about."""

    def __init__(self, auto: ByBatchSize | None) -> None:
        self.auto = auto
        self.fixed: dict[int, int] = {}  # sequence id -> its depth (0: off); absent: auto
        self._asked = False

    def next_depths(self, seqs: list[int], k_max: list[int]) -> list[int]:
        self._asked = self.auto is not None and any(s not in self.fixed for s in seqs)
        ds = self.auto.next_depths(seqs, k_max) if self._asked else list(k_max)
        return [min(self.fixed[s], k) if s in self.fixed else d for s, d, k in zip(seqs, ds, k_max)]

    def observe(self, step: BatchStep) -> None:
        if self._asked:
            self.auto.observe(step)

    def drop(self, seq: int) -> None:
        self.fixed.pop(seq, None)
        if self.auto is not None:
            self.auto.drop(seq)


class Scheduler:
    """A served model's engine on its own thread: continuous batching of every request to this model."""

    def __init__(self, name: str, model: Model, spec: Speculation, max_batch: int, max_queue: int,
                 prefill_chunk: int, metrics: ServerMetrics, exact: bool = False, prefix_cache: int = 0) -> None:
        self.name, self.model, self.spec, self.metrics = name, model, spec, metrics
        self.exact = exact  # exact mode (engine.py): width-one verify calls
        self.max_queue = max_queue
        self.max_k = self._max_depth()
        self.max_batch, self.prefill_chunk, self.prefix_cache = max_batch, prefill_chunk, prefix_cache
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

    def request_spec(self, asked: int | str | None) -> RequestSpec:
        """A request's speculation ("off", "auto", a depth D in 1..max_k, None: the server's), checked by the HTTP layer
        first. With the server's drafter "none", every request is off."""
        if asked == "off" or self.spec.drafter == "none":
            return RequestSpec(replace(self.spec, drafter="none", draft_model=None, options=()), 0)
        return RequestSpec(self.spec, self.spec.k if asked is None else asked)

    def submit(self, req: GenRequest) -> Handle:
        """Queue a generation of req.n sequences (QueueFull when they would not fit in the free slots and the queue:
        --max-batch + --max-queue sequences at most, each choice counted)."""
        with self._lock:
            if self._admitted + req.n > self.max_batch + self.max_queue:
                raise QueueFull(f"{self.queue_length()} sequences are waiting for model {self.name!r} (the server's --max-queue)")
            self._admitted += req.n
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

    def _max_depth(self) -> int:
        """The deepest fixed D a request may ask: AUTO_K_MAX (or --k, if deeper), within the drafter's own maximum
        (a Medusa head's number of heads)."""
        deepest = max(AUTO_K_MAX, self.spec.k if isinstance(self.spec.k, int) else 0)
        if self.spec.drafter == "none":
            return 0
        own = getattr(self._drafter(self.spec), "k_max", None)
        return min(deepest, own) if isinstance(own, int) and own >= 1 else deepest

    def _drafter(self, spec: Speculation):
        return make_drafter(spec.drafter, self.model.module, draft_model=spec.draft_model, **dict(spec.options))

    def _new_engine(self) -> Engine:
        deepest = auto_depth(self.model.module)
        self.depth = PerRequest(ByBatchSize(k_max=deepest) if self.spec.drafter != "none" else None)
        return Engine(self.model.module, self.max_batch, exact=self.exact, depth=self.depth, prefill_chunk=self.prefill_chunk,
                      prefixes=PrefixStore(self.prefix_cache) if self.prefix_cache else None)

    def _warm(self) -> None:
        """A compiled model's graphs, every one a request may take, built before the first request (compiled.warm) at
        the thread count its steps run with (graphs are keyed by it). A failure leaves them to be built on first use,
        where an error fails the requests in flight (_step) instead of stopping this thread."""
        if self.model.module.compiled_step is None:
            return
        if self.model.threads and torch.get_num_threads() != self.model.threads:
            apply_threads(self.model.threads)
        mtp = self.spec.drafter == "mtp"
        try:
            warm(self.model.module, self.max_k, mtp, mtp)
        except Exception as e:  # noqa: BLE001 - reported; the graphs build on first use
            print(f"mtpspec: model {self.name!r}: building its compiled graphs failed ({type(e).__name__}: {e}); "
                  "they build on first use", file=sys.stderr, flush=True)

    def _run(self) -> None:
        self._warm()
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
                for sid in handle.sids:  # the choices already added leave unanswered: the request fails as one
                    self.handles.pop(sid, None)
                    self.seqs.pop(sid, None)
                    self.engine.cancel(sid)
                self._answered(req.n)
                handle.post(Failed(f"{type(e).__name__}: {e}"))
        elif kind == "cancel":
            _, handle, index = item
            sids = handle.sids if index is None else handle.sids[index : index + 1]
            live = [sid for sid in sids if sid in self.handles]
            for sid in live:
                self.engine.cancel(sid)
            if live:
                self._collect()
        elif kind == "job":
            _, fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the awaiting request
                    fut.set_exception(e)

    def _add(self, handle: Handle, req: GenRequest) -> None:
        """The request's n sequences: the first prefills the prompt, the others take copies of its cache."""
        rs = self.request_spec(req.speculation)
        k = 1 if rs.choice == "off" else AUTO_K_MAX if rs.k == "auto" else rs.k
        seed = secrets.randbits(63) if req.seed is None else req.seed
        stop = tuple(dict.fromkeys(tuple(self.model.tokenizer.stop_ids) + req.stop_ids))
        for i in range(req.n):
            seq_box: list[Sequence] = []
            on_tokens = lambda toks, i=i, box=seq_box: self._emit(handle, i, box[0], toks)  # noqa: E731
            sid = self.engine.add(req.prompt, self._drafter(rs.spec), Sampler(req.params, choice_seed(seed, i)), k,
                                  req.max_tokens, stop, on_tokens, logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs,
                                  prefill_from=handle.sids[0] if i else None)
            seq = self.engine.waiting[-1]
            seq_box.append(seq)
            handle.sids.append(sid)
            self.handles[sid], self.seqs[sid] = handle, seq
            if rs.k != "auto":
                self.depth.fixed[sid] = 0 if rs.choice == "off" else rs.k

    def _emit(self, handle: Handle, index: int, seq: Sequence, toks: list[int]) -> None:
        now = perf_counter()
        last = handle.last_emit.get(index)
        if last is not None:
            gap = (now - last) / len(toks)
            for _ in toks:
                self.metrics.itl(gap)
        elif not handle.last_emit:  # the request's first token (the choices' firsts come in the same step)
            self.metrics.ttft(now - handle.submitted)
        handle.last_emit[index] = now
        self.metrics.generated(len(toks))
        first = seq.prompt_logprobs is not None and len(seq.new) == len(toks)  # the choice's first tokens
        handle.post(Chunk(index, list(toks), list(seq.pending_logprobs), list(seq.prompt_lps) if first else None))

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
                lps = list(seq.prompt_lps) if seq.prompt_logprobs is not None else None
                index, result = handle.sids.index(sid), seq.result()
                if index == 0:  # the choice that prefilled the prompt
                    self.metrics.prompt(len(seq.prompt), result.stats.cached_tokens)
                handle.post(Finished(index, seq.finish_reason or "length", result, lps))

    def _fail_all(self, message: str) -> None:
        """Every request in flight fails (the engine is replaced, or the server stops: it is not touched here, it may
        be the one that just raised)."""
        self._answered(len(self.handles))  # sequences
        for handle in {id(h): h for h in self.handles.values()}.values():  # each request once
            handle.post(Failed(message))
        self.handles.clear()
        self.seqs.clear()
