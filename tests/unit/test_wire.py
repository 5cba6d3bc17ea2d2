"""The constants the agent and the coordinator share are written once, in protos/wire.py."""

from __future__ import annotations

import ast
from pathlib import Path

from trialkeeper.protos import wire

ROOT = Path(__file__).resolve().parents[2]
SHARED = {
    wire.TOKEN_ENV: "TOKEN_ENV",
    wire.TOKEN_METADATA_KEY: "TOKEN_METADATA_KEY",
    wire.EXPERIMENT_ENV: "EXPERIMENT_ENV",
    wire.ENVIRONMENT_ENV: "ENVIRONMENT_ENV",
}


def _sources() -> list[Path]:
    return [p for d in ("agent", "coordinator") for p in sorted((ROOT / d).rglob("*.py"))]


def test_no_module_spells_a_shared_constant_itself() -> None:
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in SHARED:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r} (use wire.{SHARED[node.value]})")
    assert not found, "\n".join(found)


def test_no_module_defines_a_shared_name_again() -> None:
    names = {*SHARED.values(), "PROTOCOL_VERSION"}
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id in names:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {target.id}")
            # 0 is the probe's "no version", not the protocol's.
            if (isinstance(node, ast.keyword) and node.arg == "protocol_version"
                    and isinstance(node.value, ast.Constant) and node.value.value != 0):
                found.append(f"{path.relative_to(ROOT)}:{node.value.lineno}: protocol_version={node.value.value!r}")
    assert not found, "\n".join(found)
