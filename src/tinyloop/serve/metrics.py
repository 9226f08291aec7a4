"""Prometheus metrics of one server (its own registry, so several apps in one process stay apart).

Times are measured by the server around the engine: TTFT from the request's arrival to its first token,
inter-token latency between consecutive tokens of a request, end-to-end latency to its last token.
Depth comes from the engine: loops per token (the mean iterations a request's tokens ran) and the share of
tokens that stopped iterating early. Speculative acceptance stays 0: the server does not decode
speculatively yet. The prefix-pool hit rate stays 0 until the engine reports prefix hits.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tinyloop.serve.engine import RequestStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry()
        self.running = Gauge("tinyloop_requests_running", "Requests generating now", registry=reg)
        self.waiting = Gauge("tinyloop_requests_waiting", "Requests queued for the engine", registry=reg)
        self.prompt_tokens = Counter("tinyloop_prompt_tokens", "Prompt tokens of finished requests", registry=reg)
        self.generated_tokens = Counter("tinyloop_generation_tokens", "Tokens generated", registry=reg)
        self.requests = Counter(
            "tinyloop_requests_finished", "Finished requests by finish reason", ["finish_reason"], registry=reg
        )
        self.ttft = Histogram(
            "tinyloop_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS, registry=reg
        )
        self.itl = Histogram(
            "tinyloop_inter_token_latency_seconds",
            "Between consecutive tokens of a request",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "tinyloop_e2e_request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS, registry=reg
        )
        self.loops = Histogram(
            "tinyloop_loops_per_token",
            "Mean loop iterations per generated token of a request",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=reg,
        )
        self.early_exit_rate = Gauge(
            "tinyloop_early_exit_rate", "Share of generated tokens that exited early", registry=reg
        )
        self.prefix_hit_rate = Gauge(
            "tinyloop_prefix_pool_hit_rate", "Prompt tokens served by the prefix pool", registry=reg
        )
        self.spec_acceptance = Gauge(
            "tinyloop_spec_decode_acceptance_rate",
            "Share of drafted tokens accepted (0: no speculative decoding)",
            registry=reg,
        )
        self._tokens = 0
        self._early = 0
        self._prompt = 0
        self._prefix_hits = 0

    def finished(self, stats: RequestStats, finish_reason: str) -> None:
        """Account one finished request."""
        self.requests.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generated_tokens.inc(stats.generated_tokens)
        if stats.generated_tokens:
            self.loops.observe(stats.loops_per_token)
        self._tokens += stats.generated_tokens
        self._early += stats.early_exit_tokens
        self._prompt += stats.prompt_tokens
        self._prefix_hits += stats.prefix_hit_tokens
        self.early_exit_rate.set(self._early / self._tokens if self._tokens else 0.0)
        self.prefix_hit_rate.set(self._prefix_hits / self._prompt if self._prompt else 0.0)

    def render(self, counts: dict[str, Any]) -> bytes:
        self.running.set(counts.get("running", 0))
        self.waiting.set(counts.get("waiting", 0))
        return bytes(generate_latest(self.registry))
