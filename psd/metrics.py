"""Prometheus metrics for a job, read from its arena at every scrape (prometheus_client).

`psd serve --metrics-port P` serves them from the watchdog (so they outlive
server restarts), bound to 127.0.0.1 unless --metrics-host says otherwise.
The figures are those of `psd status`: counters as counters, the staleness
histogram as a histogram, and per-learner series labelled by slot, rank and pid. It reads them through
``psd.status.job_status`` (a ``JobStatus``, whose keys are declared there), never the arena's header itself.
"""

from __future__ import annotations

import logging

from psd.errors import Error
from psd.status import JobStatus, job_status, stale_bucket_label

__all__ = ["JobCollector", "serve_metrics"]

log = logging.getLogger("psd.metrics")


class JobCollector:
    """A prometheus_client collector for one job."""

    def __init__(self, job: str) -> None:
        self.job = job

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        up = GaugeMetricFamily("psd_server_up", "1 if the job's server is alive", labels=["job"])
        try:
            s: JobStatus = job_status(self.job)  # typed keys: the figures of `psd status`
        except Error:
            up.add_metric([self.job], 0)
            yield up
            return
        up.add_metric([self.job], 1 if s["server_alive"] else 0)
        yield up
        j = [self.job]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["job"])
            g.add_metric(j, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["job"])
            c.add_metric(j, value)
            return c

        yield gauge("psd_weights_clock", "updates applied to the weights so far", s["clock"])
        yield counter("psd_gradients_pushed", "gradients fully pushed by learners", s["pushed"])
        yield counter("psd_gradients_applied", "gradients applied by the update loop", s["applied"])
        yield counter("psd_gradients_rejected", "non-finite gradients rejected (never applied)", s["rejected"])
        yield counter("psd_gradients_dropped", "gradients dropped as staler than --max-staleness", s["dropped"])
        yield gauge("psd_learning_rate", "learning rate of the last update (after the schedule)", s["lr_now"])
        yield gauge("psd_gradients_pending", "gradients pushed and not yet applied", s["pending"])
        yield gauge("psd_learners_active", "learners attached", s["active_learners"])
        yield gauge("psd_server_generation", "servers started on this arena", s["generation"])
        yield counter("psd_server_restarts", "server restarts", s["server_restarts"])
        yield counter("psd_slots_reclaimed", "slots of dead learners reclaimed", s["reclaimed_slots"])
        yield gauge("psd_heartbeat_age_seconds", "age of the server's heartbeat", max(0.0, s["heartbeat_age_s"]))
        yield gauge("psd_parameters", "parameters in the model", s["n_params"])
        if s["checkpoint_clock"] is not None:
            yield gauge("psd_checkpoint_clock", "weights clock of the last checkpoint", s["checkpoint_clock"])
            yield gauge("psd_checkpoint_age_seconds", "age of the last checkpoint", s["checkpoint_age_s"])
        buckets, total = [], 0
        hist = s["staleness_hist"]
        for i in range(16):
            total += hist.get(stale_bucket_label(i), 0)
            buckets.append((str((1 << i) - 1) if i < 15 else "+Inf", total))
        h = HistogramMetricFamily("psd_staleness", "staleness of applied gradients, in clocks", labels=["job"])
        h.add_metric(j, buckets, sum_value=s["staleness_mean"] * s["applied"])
        yield h
        labels = ["job", "slot", "rank", "pid"]
        pushed = CounterMetricFamily("psd_learner_gradients_pushed", "gradients pushed by a learner", labels=labels)
        queued = GaugeMetricFamily("psd_learner_queue_depth", "gradients waiting in a learner's ring", labels=labels)
        stale = GaugeMetricFamily("psd_learner_staleness_mean", "mean staleness of a learner's gradients",
                                  labels=labels)
        loss = GaugeMetricFamily("psd_learner_loss", "loss of a learner's last applied gradient", labels=labels)
        for x in s["learners"]:
            lv = [self.job, str(x["slot"]), str(x["rank"]), str(x["pid"])]
            pushed.add_metric(lv, x["pushed"])
            queued.add_metric(lv, x["queued"])
            stale.add_metric(lv, x["staleness_mean"])
            if x["last_loss"] is not None:  # None: the learner reported no loss yet
                loss.add_metric(lv, x["last_loss"])
        yield from (pushed, queued, stale, loss)


def serve_metrics(job: str, port: int, host: str = "127.0.0.1"):
    """Start the HTTP endpoint in a daemon thread; returns the server (call .shutdown() to stop)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(JobCollector(job))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    log.info("job %r: metrics on http://%s:%d/metrics", job, host, server.server_port)
    return server
