"""ServerMetrics: every metric's value as Prometheus parses the rendered text."""

from __future__ import annotations

import threading

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from mtpspec.server.metrics import LATENCY_BUCKETS, ServerMetrics
from mtpspec.types import BatchStep, SeqStep


def batch(*counts: tuple[int, int]) -> BatchStep:
    """A step over sequences with (drafted, accepted) each."""
    seqs = tuple(SeqStep(seq=i, drafted=d, accepted=a, draft_seconds=0.0) for i, (d, a) in enumerate(counts))
    return BatchStep(rows=sum(d + 1 for d, _ in counts), width=max(d for d, _ in counts) + 1,
                     forward_seconds=0.01, overhead_seconds=0.0, seqs=seqs)


def samples(m: ServerMetrics) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of the rendered body."""
    body, kind = m.render()
    assert isinstance(body, bytes) and kind == CONTENT_TYPE_LATEST
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_fresh_metrics_are_zero():
    v = samples(ServerMetrics())
    for name in ("mtpspec_generated_tokens_total", "mtpspec_target_forwards_total", "mtpspec_drafts_total",
                 "mtpspec_draft_tokens_total", "mtpspec_accepted_tokens_total", "mtpspec_queue_length",
                 "mtpspec_running", "mtpspec_batch_size_count", "mtpspec_time_to_first_token_seconds_count",
                 "mtpspec_inter_token_latency_seconds_count"):
        assert v[(name, ())] == 0.0, name
    assert not any(name.startswith("mtpspec_requests") for name, _ in v)  # labelled: no series until a request


def test_steps_count_drafts_tokens_and_positions():
    m = ServerMetrics()
    m.step(batch((3, 1), (0, 0), (2, 2)))  # positions drafted: 1,2,3 / 1,2; accepted 1 / 1,2
    m.step(batch((4, 4)))
    m.step(batch((0, 0), (0, 0)))  # a plain step: a forward, no drafts
    v = samples(m)
    assert v[("mtpspec_target_forwards_total", ())] == 3
    assert v[("mtpspec_drafts_total", ())] == 3
    assert v[("mtpspec_draft_tokens_total", ())] == 3 + 2 + 4
    assert v[("mtpspec_accepted_tokens_total", ())] == 1 + 2 + 4
    drafted = {1: 3, 2: 3, 3: 2, 4: 1}
    accepted = {1: 3, 2: 2, 3: 1, 4: 1}
    for i in range(1, 5):
        assert v[("mtpspec_drafted_by_position_total", (("position", str(i)),))] == drafted[i], i
        assert v[("mtpspec_accepted_by_position_total", (("position", str(i)),))] == accepted[i], i
    assert ("mtpspec_drafted_by_position_total", (("position", "5"),)) not in v
    # batch sizes 3, 1, 2
    assert v[("mtpspec_batch_size_count", ())] == 3
    assert v[("mtpspec_batch_size_sum", ())] == 6
    for le, n in (("1.0", 1), ("2.0", 2), ("3.0", 3), ("8.0", 3), ("+Inf", 3)):
        assert v[("mtpspec_batch_size_bucket", (("le", le),))] == n, le


def test_requests_tokens_gauges_and_latencies():
    m = ServerMetrics()
    for endpoint, status in (("/v1/completions", 200), ("/v1/completions", 200), ("/v1/completions", 429),
                             ("/v1/chat/completions", 400), ("/metrics", 200)):
        m.request(endpoint, status)
    m.generated(5)
    m.generated(7)
    m.queue(4)
    m.running(9)
    m.queue(2)  # a gauge: the last value
    m.ttft(0.0005)
    m.ttft(0.2)
    m.ttft(40.0)
    m.itl(0.003)
    m.itl(0.003)
    v = samples(m)
    req = lambda e, s: v[("mtpspec_requests_total", (("endpoint", e), ("status", s)))]  # noqa: E731
    assert req("/v1/completions", "200") == 2
    assert req("/v1/completions", "429") == 1
    assert req("/v1/chat/completions", "400") == 1
    assert req("/metrics", "200") == 1
    assert sum(x for (name, _), x in v.items() if name == "mtpspec_requests_total") == 5
    assert v[("mtpspec_generated_tokens_total", ())] == 12
    assert v[("mtpspec_queue_length", ())] == 2
    assert v[("mtpspec_running", ())] == 9
    ttft = "mtpspec_time_to_first_token_seconds"
    assert v[(ttft + "_count", ())] == 3
    assert abs(v[(ttft + "_sum", ())] - 40.2005) < 1e-9
    expect = {b: (b >= 0.0005) + (b >= 0.2) for b in LATENCY_BUCKETS}
    for b, n in expect.items():
        assert v[(ttft + "_bucket", (("le", str(float(b))),))] == n, b
    assert v[(ttft + "_bucket", (("le", "+Inf"),))] == 3
    itl = "mtpspec_inter_token_latency_seconds"
    assert v[(itl + "_count", ())] == 2
    assert v[(itl + "_bucket", (("le", "0.0025"),))] == 0
    assert v[(itl + "_bucket", (("le", "0.005"),))] == 2
    assert LATENCY_BUCKETS[0] == 0.001 and LATENCY_BUCKETS[-1] == 30.0


def test_registries_are_private():
    a, b = ServerMetrics(), ServerMetrics()  # a second instance must not clash with the first
    a.generated(3)
    assert samples(b)[("mtpspec_generated_tokens_total", ())] == 0
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("mtpspec_generated_tokens_total") is None


def test_two_threads_lose_nothing():
    m = ServerMetrics()
    n = 2000

    def worker():  # the engine's thread
        for _ in range(n):
            m.step(batch((2, 1), (1, 0)))
            m.generated(2)

    def loop():  # the event loop's side
        for i in range(n):
            m.request("/v1/completions", 200)
            m.itl(0.01)
            m.render() if i % 500 == 0 else None

    threads = [threading.Thread(target=worker), threading.Thread(target=loop)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    v = samples(m)
    assert v[("mtpspec_target_forwards_total", ())] == n
    assert v[("mtpspec_draft_tokens_total", ())] == 3 * n
    assert v[("mtpspec_accepted_tokens_total", ())] == n
    assert v[("mtpspec_drafted_by_position_total", (("position", "1"),))] == 2 * n
    assert v[("mtpspec_accepted_by_position_total", (("position", "2"),))] == 0
    assert v[("mtpspec_generated_tokens_total", ())] == 2 * n
    assert v[("mtpspec_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == n
    assert v[("mtpspec_inter_token_latency_seconds_count", ())] == n
