"""`trialkeeper run CONFIG --print-config`: the config in NNI's v2 format, as trialkeeper
reads it (an NNI v1 file converted as nnictl converts it), then checked; nothing is run."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml


def print_config(path: Path) -> int:
    """Print the v2 form of the config at ``path`` on stdout; its problems, if any, on
    stderr (exit status 2, as `run` gives)."""
    from ..config import nniv1
    from ..config.experiment import ConfigError, parse_config, read_config_data

    try:
        file, data = read_config_data(path)
    except ConfigError as e:
        return say_invalid(path, e.issues)
    v2: Any = nniv1.to_v2(data).v2 if nniv1.is_v1(data) else data
    print(yaml.safe_dump(v2, sort_keys=False, allow_unicode=True, width=1000).rstrip())
    try:
        config = parse_config(data, file.parent)
    except ConfigError as e:
        return say_invalid(path, e.issues)
    return check_search(path, config, missing_is_a_problem=False)


def check_search(path: Path, config: Any, *, missing_is_a_problem: bool = True) -> int:
    """0, or 2 once the problems ``search_issues`` finds are said, as an invalid config's. A
    package missing here is one only for a run here (not for ``--print-config``, where the
    config may be meant for another machine: a note)."""
    issues = []
    for issue in search_issues(config):
        if issue.missing and not missing_is_a_problem:
            print(f"trialkeeper: note: {issue.where} not checked here: {issue.error}", file=sys.stderr)
        else:
            issues.append(f"{issue.where}: {issue.error}")
    return say_invalid(path, issues) if issues else 0


@dataclass(frozen=True)
class SearchIssue:
    where: str  # tuner, assessor, advisor or searchSpace
    error: ValueError

    @property
    def missing(self) -> bool:
        return getattr(self.error, "missing", None) is not None


def search_issues(config: Any) -> list[SearchIssue]:
    """What `run` would refuse when it makes the config's tuner and assessor (or advisor): an
    unknown name, a classArg they do not take or a value they refuse, a package missing here.
    They are made as `run` makes them and thrown away; nothing is kept: an Optuna study lives
    in memory, NNI's PBT names its paths under a temporary directory."""
    import tempfile

    from ..experiment import make_search
    from ..search.algorithms import create_assessor
    from ..search.assessors import AssessorError
    from ..search.tuners import TunerError

    tuner = replace(config.tuner, class_args={k: v for k, v in config.tuner.class_args.items() if k != "storage"})
    checked = replace(config, tuner=tuner, optuna_storage=None)
    a = config.assessor
    with tempfile.TemporaryDirectory(prefix="trialkeeper-check-") as tmp:
        try:
            make_search(checked, "check", Path(tmp))
        except AssessorError as e:
            return [SearchIssue("assessor", e)]
        except TunerError as e:  # and the assessor on its own, so that both are said at once
            said = [SearchIssue("advisor" if config.advisor is not None else "tuner", e)]
            if a is not None and a.name is not None and a.name.lower() != "optuna":
                try:
                    create_assessor(a.name, a.class_name, dict(a.class_args))
                except AssessorError as e2:
                    said.append(SearchIssue("assessor", e2))
            return said
        except ValueError as e:  # the search space, as the tuner reads it
            return [SearchIssue("searchSpace", e)]
    return []


def say_invalid(path: Path | str | None, issues: list[Any]) -> int:
    """Say a config's problems on stderr, one to a line when there are several; the exit status
    of an invalid config (2)."""
    # Plain prints: rich would wrap long messages at 80 columns when not on a terminal.
    if len(issues) == 1:
        print(f"trialkeeper: invalid config {path}: {issues[0]}", file=sys.stderr)
    else:
        print(f"trialkeeper: invalid config {path}:", file=sys.stderr)
        for issue in issues:
            print(f"  {issue}", file=sys.stderr)
    return 2
