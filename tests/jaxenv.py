"""The interpreter with JAX's CPU wheel that the multi-node tests run their trials in: their
ranks join a real collective (an all-gather over gloo), not only the rendezvous variables."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

MAKE = (
    "python3 -m venv .venv-jax && .venv-jax/bin/pip install -q jax -e . && "
    "export TRIALKEEPER_JAX_PYTHON=$PWD/.venv-jax/bin/python"
)


def jax_python() -> str:
    """The python $TRIALKEEPER_JAX_PYTHON names; fails under CI and skips elsewhere without it."""
    path = os.environ.get("TRIALKEEPER_JAX_PYTHON", "")
    if path and Path(path).is_file():
        return path
    why = f"TRIALKEEPER_JAX_PYTHON does not name a python with jax installed ({path or 'unset'}); make one: {MAKE}"
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)
