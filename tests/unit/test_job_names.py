"""Platform job names: an experiment's sweep takes its own jobs only."""

from __future__ import annotations

from trialkeeper.coordinator.services._jobs import env_of, job_name
from trialkeeper.coordinator.services.base import env_id_in_name
from trialkeeper.coordinator.services.dlc.sdk import display_name, name_prefix


def test_a_job_name_gives_back_its_environment() -> None:
    assert env_of(job_name("ab", "env-3"), "ab") == "env-3"
    assert env_id_in_name(display_name("ab", "env-12"), name_prefix("ab")) == "env-12"


def test_an_experiment_id_that_prefixes_another_takes_none_of_its_jobs() -> None:
    # Ids given by an embedder may hold dashes: "ab" must not sweep the jobs of "ab-cd".
    other = job_name("ab-cd", "env-1")
    assert other.startswith(job_name("ab", ""))
    assert env_of(other, "ab") is None
    assert env_of(other, "ab-cd") == "env-1"
    assert env_id_in_name(display_name("ab-env-1", "env-2"), name_prefix("ab")) is None


def test_names_that_are_not_ours_are_ignored() -> None:
    for name in ("", "tk-ab-", "tk-ab-env-", "tk-ab-env-x", "tk-ab-env-1-", "other-ab-env-1", "tk-ab-env-1\n"):
        assert env_of(name, "ab") is None, name
