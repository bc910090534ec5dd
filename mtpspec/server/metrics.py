"""The server's Prometheus metrics (GET /metrics), on a registry of its own.

Every app gets a private CollectorRegistry (tests build many apps; the global registry would refuse
the second). Speculation counters follow mtpspec.types' vocabulary and vLLM's names: a **draft** is
one sequence's drafted run in one step (drafted > 0), **draft tokens** the tokens in it, **accepted
tokens** the ones verification kept. By position: a SeqStep with drafted = d, accepted = a drafts
positions 1..d and accepts 1..a, so accepted_by_position / drafted_by_position at label i is the
acceptance rate of position i given that it was drafted.

Methods are called from the engine's worker thread and the event loop; prometheus_client's metrics
lock their own values, and this class keeps no other state.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..types import BatchStep

# 1 ms .. 30 s, roughly x2.5 apart: a token of a small model on CPU to a long prompt's prefill behind a queue.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Sequences in one engine step: every size up to 8, then powers of two-ish.
BATCH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 128, 256)


class ServerMetrics:
    """Counters, gauges and histograms of one server; `render()` is the /metrics body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._requests = Counter("mtpspec_requests", "HTTP requests answered, by endpoint and status code",
                                 ["endpoint", "status"], registry=r)
        self._generated = Counter("mtpspec_generated_tokens", "Tokens generated (sent to clients)", registry=r)
        self._forwards = Counter("mtpspec_target_forwards", "Decode steps: one batched target forward each", registry=r)
        self._drafts = Counter("mtpspec_drafts", "Sequence-steps with at least one drafted token", registry=r)
        self._draft_tokens = Counter("mtpspec_draft_tokens", "Tokens drafted", registry=r)
        self._accepted_tokens = Counter("mtpspec_accepted_tokens", "Draft tokens accepted by verification", registry=r)
        self._drafted_at = Counter("mtpspec_drafted_by_position", "Draft tokens at each draft position (1 = first)",
                                   ["position"], registry=r)
        self._accepted_at = Counter("mtpspec_accepted_by_position", "Accepted draft tokens at each draft position",
                                    ["position"], registry=r)
        self._prompt = Counter("mtpspec_prompt_tokens", "Prompt tokens of finished requests (once per request)", registry=r)
        self._cached = Counter("mtpspec_prompt_tokens_cached", "Of those, positions copied from a kept prefix (--prefix-cache) "
                               "instead of prefilled", registry=r)
        self._batch = Histogram("mtpspec_batch_size", "Sequences in one decode step", buckets=BATCH_BUCKETS, registry=r)
        self._queue = Gauge("mtpspec_queue_length", "Requests waiting for a slot in the running batch", registry=r)
        self._running = Gauge("mtpspec_running", "Sequences in the running batch", registry=r)
        self._ttft = Histogram("mtpspec_time_to_first_token_seconds", "From request arrival to its first token",
                               buckets=LATENCY_BUCKETS, registry=r)
        self._itl = Histogram("mtpspec_inter_token_latency_seconds", "Between consecutive tokens of one request",
                              buckets=LATENCY_BUCKETS, registry=r)

    def request(self, endpoint: str, status: int) -> None:
        """One answered request; `endpoint` should be a route (bounded set), not the raw path."""
        self._requests.labels(endpoint=endpoint, status=str(int(status))).inc()

    def generated(self, n: int) -> None:
        self._generated.inc(n)

    def step(self, rec: BatchStep) -> None:
        """One engine step: a target forward, its batch size, and every sequence's drafted / accepted counts."""
        self._forwards.inc()
        self._batch.observe(len(rec.seqs))
        drafted_at = [0] * max((s.drafted for s in rec.seqs), default=0)  # [i-1]: sequences that drafted position i
        accepted_at = [0] * len(drafted_at)  # [i-1]: sequences whose position i was accepted
        for s in rec.seqs:
            for i in range(s.drafted):
                drafted_at[i] += 1
            for i in range(s.accepted):
                accepted_at[i] += 1
        for i, (d, a) in enumerate(zip(drafted_at, accepted_at), start=1):
            self._drafted_at.labels(position=str(i)).inc(d)
            self._accepted_at.labels(position=str(i)).inc(a)
        self._drafts.inc(sum(1 for s in rec.seqs if s.drafted > 0))
        self._draft_tokens.inc(sum(drafted_at))
        self._accepted_tokens.inc(sum(accepted_at))

    def prompt(self, tokens: int, cached: int) -> None:
        """A finished request's prompt: its tokens, and the positions its prefill copied from a kept prefix."""
        self._prompt.inc(tokens)
        self._cached.inc(cached)

    def queue(self, n: int) -> None:
        self._queue.set(n)

    def running(self, n: int) -> None:
        self._running.set(n)

    def ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def itl(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of GET /metrics: the Prometheus text format."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
