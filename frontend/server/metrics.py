"""The server's Prometheus metrics, under vLLM's names with a `minivllm:` prefix.

Engine-wide numbers (running / waiting requests, KV cache usage, prefix cache, preemptions) come
from the engine's stats, fetched when /metrics is scraped; per-request numbers (token counts,
finish reasons, TTFT, inter-token and end-to-end latency, lengths) are observed here, from the
stream of outputs each request gets.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from minivllm.protocol.messages import EngineStats

PREFIX = "minivllm:"

# vLLM's bucket boundaries (seconds), so dashboards made for it read ours the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


def length_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's 1-2-5 series)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return buckets
            buckets.append(step * scale)
        scale *= 10


class EngineStatsCollector:
    """Exposes the engine's latest stats (set by the /metrics handler before each scrape)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def collect(self):
        s = self.stats
        labels = ["model_name"]
        values = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield gauge("num_requests_running", "Requests in the engine's running batch.",
                    s.num_running_reqs if s else 0)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting_reqs if s else 0)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = all).",
                    s.kv_cache_usage if s else 0.0)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries if s else 0)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits if s else 0)
        yield counter("num_preemptions", "Requests preempted (KV blocks freed, recomputed later).",
                      s.num_preemptions if s else 0)
        # Speculative decoding (vLLM's spec_decode_* counters; zero when it is off).
        yield counter("spec_decode_num_drafts", "Request steps that verified draft tokens.",
                      s.spec_decode_num_drafts if s else 0)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                      s.spec_decode_num_draft_tokens if s else 0)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      s.spec_decode_num_accepted_tokens if s else 0)
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft (0 = first).",
                                      labels=[*labels, "position"])
        for position, count in enumerate(s.spec_decode_num_accepted_tokens_per_pos if s else []):
            per_pos.add_metric([*values, str(position)], count)
        yield per_pos


class ServerMetrics:
    """All of the server's metrics, in a registry of their own (one per server)."""

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.registry = CollectorRegistry()
        self.engine = EngineStatsCollector(model_name)
        self.registry.register(self.engine)
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of requests.", labels, registry=r
                                     ).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", labels, registry=r
                                         ).labels(model_name)
        self.request_success = Counter(PREFIX + "request_success", "Completions finished, by reason.",
                                       ["model_name", "finished_reason"], registry=r)
        self.model_name = model_name
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token, from arrival.",
                              labels, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between a completion's outputs.",
                             labels, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token, per completion.",
                             labels, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        buckets = length_buckets(max_model_len)
        self.prompt_len = Histogram(PREFIX + "request_prompt_tokens", "Prompt tokens per request.", labels,
                                    buckets=buckets, registry=r).labels(model_name)
        self.generation_len = Histogram(PREFIX + "request_generation_tokens", "Tokens generated per completion.",
                                        labels, buckets=buckets, registry=r).labels(model_name)

    def finished(self, reason: str) -> None:
        self.request_success.labels(self.model_name, reason).inc()


class RequestTimer:
    """One prompt's timings as its outputs stream in (all its n completions): the first token's
    time, each completion's previous output, and lengths; observed into ServerMetrics."""

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival  # time.monotonic() when the HTTP request came in
        self.first_token: float | None = None
        self.last_output: dict[int, float] = {}

    def prompt(self, num_prompt_tokens: int) -> None:
        self.metrics.prompt_tokens.inc(num_prompt_tokens)
        self.metrics.prompt_len.observe(num_prompt_tokens)

    def tokens(self, index: int, num_new_tokens: int, now: float | None = None) -> None:
        if not num_new_tokens:
            return
        now = time.monotonic() if now is None else now
        m = self.metrics
        m.generation_tokens.inc(num_new_tokens)
        if self.first_token is None:
            self.first_token = now
            m.ttft.observe(now - self.arrival)
        previous = self.last_output.get(index)
        if previous is not None:
            m.itl.observe(now - previous)
        self.last_output[index] = now

    def finished(self, index: int, reason: str, num_tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        m = self.metrics
        m.finished(reason)
        m.e2e.observe(now - self.arrival)
        m.generation_len.observe(num_tokens)
