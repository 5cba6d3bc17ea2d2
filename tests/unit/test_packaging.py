"""The wheel ships every package of the checkout: pyproject.toml lists its packages one by one,
so a new folder of modules must be named there too (scripts/ci_wheel_check builds the wheel and
checks the same after the fact; this says it at once)."""

from __future__ import annotations

from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]


def _checkout_packages(setuptools: dict) -> set[str]:
    found = set()
    for name, folder in setuptools["package-dir"].items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            parts = init.parent.relative_to(root).parts
            if any(p.startswith(".") or p == "__pycache__" for p in parts):
                continue
            found.add(".".join([name, *parts]))
    return found


def test_every_package_of_the_checkout_is_listed_in_pyproject() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = _checkout_packages(setuptools)
    assert "trialkeeper.coordinator.engine" in found  # the walk sees the tree at all
    assert sorted(found - listed) == [], "add these to [tool.setuptools] packages in pyproject.toml"
    assert sorted(listed - found) == [], "pyproject.toml lists packages the checkout no longer has"
