"""The interpreters with NNI's real package that NNI tests run the coordinator in."""

from __future__ import annotations

from interpreters import interpreter

MAKE = (
    "python3 -m venv .venv-nni && .venv-nni/bin/pip install -q nni==3.0 scikit-learn -e . && "
    "export TRIALKEEPER_NNI_PYTHON=$PWD/.venv-nni/bin/python"
)


def nni_python(variable: str = "TRIALKEEPER_NNI_PYTHON") -> str:
    """The python that ``variable`` names; fails under CI and skips elsewhere without it."""
    return interpreter(variable, "nni", MAKE)
