"""The interpreters of their own that some tests run trials or tools in, each named by an
environment variable that CI's ``.ci/run`` exports: missing, a test fails under CI and is
skipped elsewhere, saying how to make one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

JAX_MAKE = (
    "python3 -m venv .venv-jax && .venv-jax/bin/pip install -q jax -e . && "
    "export TRIALKEEPER_JAX_PYTHON=$PWD/.venv-jax/bin/python"
)


def interpreter(variable: str, holding: str, make: str, *, required_in_ci: bool = True) -> str:
    """The python ``variable`` names, one with ``holding`` installed; when it names none, the
    test fails under CI (where ``required_in_ci``) and is skipped elsewhere."""
    path = os.environ.get(variable, "")
    if path and Path(path).is_file() and os.access(path, os.X_OK):
        return path
    why = f"{variable} does not name an interpreter with {holding} installed ({path or 'unset'}); make one: {make}"
    if required_in_ci and os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


def jax_python() -> str:
    """The python the multi-node tests run their trials in: JAX's CPU wheel, so that their
    ranks join a real collective (an all-gather over gloo), not only the rendezvous variables."""
    return interpreter("TRIALKEEPER_JAX_PYTHON", "jax", JAX_MAKE)
