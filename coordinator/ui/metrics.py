"""Prometheus metrics of an experiment, read from its read model at each scrape.

The series are bounded by what is alive: GPUs of the environments not ended, trials and
environments counted per status (one label name, ``status``, throughout), never one series
per ended environment or trial. Durations are histograms in seconds, utilisation a ratio
(0-1), counters end in ``_total``, as Prometheus's conventions ask."""

from __future__ import annotations

import platform
from collections.abc import Sequence
from importlib import metadata

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from .. import EnvStatus, TrialStatus  # the public API
from ..read.census import environment_census, trial_durations
from ..read.model import EnvSnapshot, ReadModel

# Upper bounds (seconds) of the trial duration histogram: a second to a day.
TRIAL_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0, 43200.0, 86400.0)
# The statuses a stored experiment has (a status this version does not know is shown too).
EXPERIMENT_STATUSES = ("RUNNING", "DONE", "STOPPED", "FAILED")

# What the coordinator says of its scheduling passes: (passes, seconds in all, the latest
# one's seconds), optionally followed by (upper bound, passes that took at most that) pairs,
# cumulative; without them the histogram has its +Inf bucket only.
Scheduling = tuple[int, float, float] | tuple[int, float, float, Sequence[tuple[float, int]]]


def _version() -> str:
    try:
        return metadata.version("trialkeeper")
    except metadata.PackageNotFoundError:
        return "unknown"


def _buckets(bounds: Sequence[float], under: Sequence[int], count: int) -> list[tuple[str, float]]:
    return [*((f"{b:g}", float(n)) for b, n in zip(bounds, under)), ("+Inf", float(count))]


class ExperimentCollector(Collector):
    """One scrape: a snapshot of the experiment, its live environments and their GPUs."""

    def __init__(self, model: ReadModel, scheduling: Scheduling | None) -> None:
        self.model = model
        self.scheduling = scheduling

    def collect(self) -> list[Metric]:  # type: ignore[override]
        exp = self.model.experiment()
        census = environment_census(self.model)
        experiment = exp.id if exp else ""
        out: list[Metric] = []

        info = GaugeMetricFamily(
            "trialkeeper_build_info", "The trialkeeper version serving these metrics.", labels=["version", "python"]
        )
        info.add_metric([_version(), platform.python_version()], 1)
        out.append(info)

        state = GaugeMetricFamily(
            "trialkeeper_experiment_status", "1 for the experiment's status, 0 for the others.",
            labels=["experiment", "status"],
        )
        current = exp.status if exp else ""
        for status in [*EXPERIMENT_STATUSES, *([current] if current and current not in EXPERIMENT_STATUSES else [])]:
            state.add_metric([experiment, status], 1 if status == current else 0)
        out.append(state)

        trials = GaugeMetricFamily("trialkeeper_trials", "Trials by status.", labels=["experiment", "status"])
        counts = dict(exp.trials) if exp else {}
        known = [s.value for s in TrialStatus]
        for status in known + sorted(set(counts) - set(known)):
            trials.add_metric([experiment, status], counts.get(status, 0))
        out.append(trials)
        ended = CounterMetricFamily(
            "trialkeeper_trials_ended", "Trials that ended, by how.", labels=["experiment", "status"]
        )
        for s in TrialStatus:
            if s.terminal:
                ended.add_metric([experiment, s.value], counts.get(s.value, 0))
        out.append(ended)
        queue = GaugeMetricFamily("trialkeeper_queue_length", "Trials waiting for a place.", labels=["experiment"])
        queue.add_metric([experiment], counts.get(TrialStatus.WAITING.value, 0))
        out.append(queue)

        durations = trial_durations(self.model, TRIAL_BUCKETS)
        took = HistogramMetricFamily(
            "trialkeeper_trial_duration_seconds", "How long the ended trials ran, in all their attempts.",
            labels=["experiment"],
        )
        took.add_metric(
            [experiment], _buckets(durations.bounds, durations.under, durations.count), durations.total_s
        )
        out.append(took)

        if exp is not None and exp.best is not None and exp.best.final_metric is not None:
            best = GaugeMetricFamily(
                "trialkeeper_best_final_metric", "The best final metric so far (the tuner's optimize_mode).",
                labels=["experiment", "optimize_mode"],
            )
            best.add_metric([experiment, exp.optimize_mode], exp.best.final_metric)
            out.append(best)

        by_status = GaugeMetricFamily(
            "trialkeeper_environments", "Environments by status.", labels=["experiment", "status"]
        )
        known = [s.value for s in EnvStatus]
        for status in known + sorted(set(census.counts) - set(known)):
            by_status.add_metric([experiment, status], census.counts.get(status, 0))
        out.append(by_status)

        connected = GaugeMetricFamily(
            "trialkeeper_agents_connected", "Agents with an open stream.", labels=["experiment"]
        )
        connected.add_metric([experiment], sum(1 for e in census.alive if e.connected))
        out.append(connected)

        stored = CounterMetricFamily("trialkeeper_metrics_stored", "Trial metrics stored.", labels=["experiment"])
        stored.add_metric([experiment], exp.metrics if exp else 0)
        out.append(stored)

        if self.scheduling is not None:
            out += self._scheduling(experiment, self.scheduling)
        out += self._gpus(experiment, census.alive)
        return out

    @staticmethod
    def _scheduling(experiment: str, scheduling: Scheduling) -> list[Metric]:
        passes, total, last = scheduling[0], scheduling[1], scheduling[2]
        pairs: Sequence[tuple[float, int]] = scheduling[3] if len(scheduling) > 3 else ()  # type: ignore[misc]
        bounds, under = [b for b, _ in pairs], [n for _, n in pairs]
        seconds = HistogramMetricFamily(
            "trialkeeper_scheduling_pass_seconds", "How long scheduling passes took.", labels=["experiment"]
        )
        seconds.add_metric([experiment], _buckets(bounds, under, passes), total)
        latest = GaugeMetricFamily(
            "trialkeeper_scheduling_pass_last_seconds", "How long the latest scheduling pass took.",
            labels=["experiment"],
        )
        latest.add_metric([experiment], last)
        return [seconds, latest]

    @staticmethod
    def _gpus(experiment: str, alive: Sequence[EnvSnapshot]) -> list[Metric]:
        names = ["experiment", "environment", "gpu", "uuid", "simulated"]
        util = GaugeMetricFamily(
            "trialkeeper_gpu_utilization_ratio", "GPU utilisation at the latest sample (0-1).", labels=names
        )
        used = GaugeMetricFamily(
            "trialkeeper_gpu_memory_used_bytes", "GPU memory used at the latest sample.", labels=names
        )
        total_mem = GaugeMetricFamily("trialkeeper_gpu_memory_total_bytes", "GPU memory in all.", labels=names)
        for e in alive:
            for g in e.gpus:
                labels = [
                    experiment, e.id, "" if g.index is None else str(g.index), g.uuid,
                    "true" if g.simulated else "false",
                ]
                if g.utilization_percent is not None:
                    util.add_metric(labels, g.utilization_percent / 100.0)
                if g.memory_used_bytes is not None:
                    used.add_metric(labels, g.memory_used_bytes)
                if g.memory_total_bytes is not None:
                    total_mem.add_metric(labels, g.memory_total_bytes)
        return [util, used, total_mem]


def metrics_text(model: ReadModel, scheduling: Scheduling | None) -> tuple[bytes, str]:
    """The exposition text of one scrape, and its content type."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ExperimentCollector(model, scheduling))
    return generate_latest(registry), CONTENT_TYPE_LATEST
