"""Prometheus metrics of an experiment, read from its read model at each scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from .. import EnvStatus, TrialStatus  # the public API
from ..read.model import ReadModel


class ExperimentCollector(Collector):
    """One scrape: a snapshot of the experiment, its environments and their GPUs."""

    def __init__(self, model: ReadModel, scheduling: tuple[int, float, float] | None) -> None:
        self.model = model
        self.scheduling = scheduling

    def collect(self) -> list[Metric]:  # type: ignore[override]
        exp = self.model.experiment()
        envs = self.model.environments()
        labels = {"experiment": exp.id if exp else ""}
        out: list[Metric] = []

        trials = GaugeMetricFamily("trialkeeper_trials", "Trials by status.", labels=["experiment", "status"])
        counts = dict(exp.trials) if exp else {}
        for status in [s.value for s in TrialStatus] + sorted(set(counts) - {s.value for s in TrialStatus}):
            trials.add_metric([labels["experiment"], status], counts.get(status, 0))
        out.append(trials)
        queue = GaugeMetricFamily("trialkeeper_queue_length", "Trials waiting for a place.", labels=["experiment"])
        queue.add_metric([labels["experiment"]], counts.get(TrialStatus.WAITING.value, 0))
        out.append(queue)

        by_state = GaugeMetricFamily(
            "trialkeeper_environments", "Environments by state.", labels=["experiment", "state"]
        )
        env_counts: dict[str, int] = {}
        for e in envs:
            key = e.status.value if e.status is not None else "UNREADABLE"
            env_counts[key] = env_counts.get(key, 0) + 1
        for state in [s.value for s in EnvStatus] + sorted(set(env_counts) - {s.value for s in EnvStatus}):
            by_state.add_metric([labels["experiment"], state], env_counts.get(state, 0))
        out.append(by_state)

        connected = GaugeMetricFamily(
            "trialkeeper_agents_connected", "Agents with an open stream.", labels=["experiment"]
        )
        connected.add_metric([labels["experiment"]], sum(1 for e in envs if e.connected))
        out.append(connected)

        stored = CounterMetricFamily("trialkeeper_metrics_stored", "Trial metrics stored.", labels=["experiment"])
        stored.add_metric([labels["experiment"]], exp.metrics if exp else 0)
        out.append(stored)

        if self.scheduling is not None:
            passes, total, last = self.scheduling
            seconds = CounterMetricFamily(
                "trialkeeper_scheduling_pass_seconds", "Time spent in scheduling passes.", labels=["experiment"]
            )
            seconds.add_metric([labels["experiment"]], total)
            out.append(seconds)
            count = CounterMetricFamily(
                "trialkeeper_scheduling_passes", "Scheduling passes run.", labels=["experiment"]
            )
            count.add_metric([labels["experiment"]], passes)
            out.append(count)
            latest = GaugeMetricFamily(
                "trialkeeper_scheduling_pass_last_seconds",
                "How long the latest scheduling pass took.",
                labels=["experiment"],
            )
            latest.add_metric([labels["experiment"]], last)
            out.append(latest)

        names = ["experiment", "environment", "gpu", "uuid"]
        util = GaugeMetricFamily(
            "trialkeeper_gpu_utilization_percent", "GPU utilisation at the latest sample.", labels=names
        )
        used = GaugeMetricFamily(
            "trialkeeper_gpu_memory_used_bytes", "GPU memory used at the latest sample.", labels=names
        )
        total_mem = GaugeMetricFamily("trialkeeper_gpu_memory_total_bytes", "GPU memory in all.", labels=names)
        for e in envs:
            for g in e.gpus:
                gpu_labels = [labels["experiment"], e.id, "" if g.index is None else str(g.index), g.uuid]
                if g.utilization_percent is not None:
                    util.add_metric(gpu_labels, g.utilization_percent)
                if g.memory_used_bytes is not None:
                    used.add_metric(gpu_labels, g.memory_used_bytes)
                if g.memory_total_bytes is not None:
                    total_mem.add_metric(gpu_labels, g.memory_total_bytes)
        out += [util, used, total_mem]
        return out


def metrics_text(model: ReadModel, scheduling: tuple[int, float, float] | None) -> tuple[bytes, str]:
    """The exposition text of one scrape, and its content type."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ExperimentCollector(model, scheduling))
    return generate_latest(registry), CONTENT_TYPE_LATEST
