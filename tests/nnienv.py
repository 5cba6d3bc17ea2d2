"""The interpreters with NNI's real package that NNI tests run the coordinator in."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

MAKE = (
    "python3 -m venv .venv-nni && .venv-nni/bin/pip install -q nni==3.0 scikit-learn -e . && "
    "export TRIALKEEPER_NNI_PYTHON=$PWD/.venv-nni/bin/python"
)


def nni_python(variable: str = "TRIALKEEPER_NNI_PYTHON") -> str:
    """The python that ``variable`` names; fails under CI and skips elsewhere without it."""
    path = os.environ.get(variable, "")
    if path and Path(path).is_file():
        return path
    why = f"{variable} does not name an interpreter with nni installed ({path or 'unset'}); make one: {MAKE}"
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)
