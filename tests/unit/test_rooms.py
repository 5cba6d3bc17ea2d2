"""The floor plan holds: a few modules at the coordinator's top, every module of a size one
reads in a sitting, the engine's machines and the platforms' services smaller still."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COORDINATOR = REPO / "coordinator"


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def _too_long(paths: list[Path], limit: int) -> dict[str, int]:
    return {str(p.relative_to(REPO)): n for p in paths if (n := _lines(p)) > limit}


def test_at_most_ten_modules_at_the_coordinators_top() -> None:
    top = sorted(p.name for p in COORDINATOR.glob("*.py"))
    assert len(top) <= 10, top


def test_no_module_of_the_coordinator_or_the_agent_over_600_lines() -> None:
    paths = [*COORDINATOR.rglob("*.py"), *(REPO / "agent").rglob("*.py")]
    assert paths and _too_long(paths, 600) == {}


def test_no_service_module_over_350_lines() -> None:
    paths = list((COORDINATOR / "services").rglob("*.py"))
    assert len(paths) > 20 and _too_long(paths, 350) == {}


def test_each_machine_of_the_engine_under_450_lines() -> None:
    machines = [COORDINATOR / "engine" / f"{m}.py" for m in ("engine", "book", "fleet", "supply")]
    assert _too_long(machines, 449) == {}
