"""The interpreters with NNI's real package that the NNI tests run trials (and read NNI's
schema) with: ``TRIALKEEPER_NNI_PYTHON`` (nni 3.0) and ``TRIALKEEPER_NNI2_PYTHON`` (2.10.1),
which CI's ``.ci/run`` exports. Missing, a test fails under CI and is skipped elsewhere."""

from __future__ import annotations

from pathlib import Path

from interpreters import interpreter

MAKE = {
    "TRIALKEEPER_NNI_PYTHON": "python3 -m venv .venv-nni && "
    ".venv-nni/bin/pip install 'nni==3.0' scikit-learn -e '.[remote]' "
    "&& export TRIALKEEPER_NNI_PYTHON=$PWD/.venv-nni/bin/python",
    "TRIALKEEPER_NNI2_PYTHON": "python3 -m venv .venv-nni2 && "
    ".venv-nni2/bin/pip install 'nni==2.10.1' scikit-learn -e . "
    "&& export TRIALKEEPER_NNI2_PYTHON=$PWD/.venv-nni2/bin/python",
}


def nni_python(variable: str = "TRIALKEEPER_NNI_PYTHON") -> Path:
    """The interpreter named by `variable`; fails under CI, skips elsewhere, when it is missing."""
    return Path(interpreter(variable, "NNI", MAKE[variable], required_in_ci=variable == "TRIALKEEPER_NNI_PYTHON"))
