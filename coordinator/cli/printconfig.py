"""`trialkeeper run CONFIG --print-config`: the config in NNI's v2 format, as trialkeeper
reads it (an NNI v1 file converted as nnictl converts it), then checked; nothing is run."""

from __future__ import annotations

import sys
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
        return _invalid(path, e)
    v2: Any = nniv1.to_v2(data).v2 if nniv1.is_v1(data) else data
    print(yaml.safe_dump(v2, sort_keys=False, allow_unicode=True, width=1000).rstrip())
    try:
        parse_config(data, file.parent)
    except ConfigError as e:
        return _invalid(path, e)
    return 0


def _invalid(path: Path, e: Any) -> int:
    issues = e.issues
    if len(issues) == 1:
        print(f"trialkeeper: invalid config {path}: {issues[0]}", file=sys.stderr)
    else:
        print(f"trialkeeper: invalid config {path}:", file=sys.stderr)
        for issue in issues:
            print(f"  {issue}", file=sys.stderr)
    return 2
