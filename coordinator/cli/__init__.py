"""The ``trialkeeper`` command line: ``app`` parses and runs, ``views`` renders the reading
commands."""

from __future__ import annotations

from .app import main

__all__ = ["main"]
