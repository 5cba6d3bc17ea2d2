"""No import cycles in coordinator/ and agent/, and a config imports only its platform.

Two checks of cycles: one statically, over the graph of every import statement that can
run (those under `if TYPE_CHECKING:` never do), so that a cycle cannot come back even in
a module no test imports; and one at run time, importing each module on its own in a
fresh interpreter while watching for an import that reaches a module still being
initialised (the sign of a cycle, which a static walk misses when the import is made
with importlib).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("coordinator", "agent")
PLATFORM_MODULE_WORDS = ("local", "kubernetes", "k8s", "slurm", "aml", "dlc", "dlts", "openpai", "ray", "remote", "ssh")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["trialkeeper", *parts])


MODULES = {_module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, *, type_checking: bool = False) -> set[str]:
    """The modules of MODULES that `name` imports by a statement that can run, and with
    ``type_checking`` those under `if TYPE_CHECKING:` too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str, names: list[str]) -> None:
        for alias in names:
            sub = f"{target}.{alias}"
            if sub in MODULES:
                found.add(sub)
            elif target in MODULES:
                found.add(target)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_checking:
                for stmt in child.orelse:
                    visit_one(stmt)
            else:
                visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            add(target, [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in MODULES)
        visit(node)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    found.discard(name)
    return found


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of more than one module (Tarjan), and each module
    that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return cycles


def test_cycle_finder_finds_cycles() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_has_no_cycle() -> None:
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    assert graph["trialkeeper.coordinator.config.experiment"], "the walker found no imports: it is broken"
    assert find_cycles(graph) == []


def test_no_cycle_at_type_checking_level_either() -> None:
    graph = {name: _imports(name, path, type_checking=True) for name, path in MODULES.items()}
    assert find_cycles(graph) == []


# ---- the rooms: which layer may import which --------------------------------------------------

C = "trialkeeper.coordinator"
# The decision core's data, which the store and the read side speak; not its machines.
CORE_DATA = tuple(f"{C}.engine.{m}" for m in ("events", "rows", "states", "model", "checkpoints"))
# (who, what it must not import, what of that it may): prefixes of module names.
FORBIDDEN = [
    ("the core imports nothing outside the core", f"{C}.engine", ("trialkeeper.",), (f"{C}.engine",)),
    ("the transport takes from the core only its events", f"{C}.transport", (f"{C}.engine", f"{C}.shell",
     f"{C}.core", f"{C}.store", f"{C}.read"),
     (f"{C}.engine.events", f"{C}.engine.rows", f"{C}.engine.checkpoints")),
    ("the store imports none of the engine's machines", f"{C}.store", (f"{C}.engine",), CORE_DATA),
    ("the read side imports none of the engine's machines, and no search", f"{C}.read", (f"{C}.engine",
     f"{C}.shell", f"{C}.core", f"{C}.store.store", f"{C}.search"), CORE_DATA),
    ("the dashboard imports no engine, shell, server or CLI", f"{C}.ui", (f"{C}.engine", f"{C}.shell",
     f"{C}.transport", f"{C}.store.store", f"{C}.core", f"{C}.cli"), ()),
    ("the control client, below the CLI and the dashboard, imports nothing of theirs or the core's",
     f"{C}.control", ("trialkeeper.",), ()),
    ("the CLI imports no engine, shell or writing store", f"{C}.cli", (f"{C}.engine.", f"{C}.shell",
     f"{C}.store.store"), CORE_DATA),
    ("the search uses only the public API (and its own config)", f"{C}.search", ("trialkeeper.",),
     (f"{C}.search", f"{C}.config")),
    ("services see the core only through their contract", f"{C}.services", (f"{C}.engine.engine",
     f"{C}.engine.book", f"{C}.engine.fleet", f"{C}.shell", f"{C}.core", f"{C}.store", f"{C}.read"), ()),
]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix if prefix.endswith(".") else prefix + ".")


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import that breaks a rule of FORBIDDEN, said as 'rule: importer -> imported'.
    The package face (``trialkeeper.coordinator``, the public API) may always be imported."""
    found = []
    for rule, who, banned, allowed in FORBIDDEN:
        for name, targets in graph.items():
            if not _under(name, who):
                continue
            for t in sorted(targets):
                if t in (C, "trialkeeper") or _under(t, who) or any(_under(t, a) for a in allowed):
                    continue
                if any(_under(t, b) or t.startswith(b) for b in banned):
                    found.append(f"{rule}: {name} -> {t}")
    return found


def test_the_rules_catch_a_forbidden_import() -> None:
    assert violations({f"{C}.engine.book": {f"{C}.store.store"}}) == [
        f"the core imports nothing outside the core: {C}.engine.book -> {C}.store.store"
    ]
    assert violations({f"{C}.ui.views": {f"{C}.engine.states"}})
    assert violations({f"{C}.read.model": {f"{C}.engine.fleet"}})
    assert not violations({f"{C}.read.model": {f"{C}.engine.model", C}})
    assert violations({f"{C}.ui.home": {f"{C}.cli.control"}})
    assert violations({f"{C}.read.pareto": {f"{C}.search.objectives"}})
    assert violations({f"{C}.control.client": {f"{C}.cli.control"}})
    assert not violations({f"{C}.ui.home": {f"{C}.control.client"}, f"{C}.read.pareto": {f"{C}.config.objectives"}})


def test_no_layer_imports_what_it_must_not() -> None:
    graph = {name: _imports(name, path, type_checking=True) for name, path in MODULES.items()}
    assert violations(graph) == []


_PURE = textwrap.dedent(
    """
    import json, sys
    import trialkeeper.coordinator.engine.engine
    banned = ("sqlite3", "asyncio", "grpc", "google.protobuf", "trialkeeper.coordinator.store",
              "trialkeeper.coordinator.read", "trialkeeper.coordinator.services",
              "trialkeeper.coordinator.platforms", "trialkeeper.coordinator.shell",
              "trialkeeper.coordinator.transport")
    print(json.dumps(sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in banned))))
    """
)


def test_the_core_is_sealed() -> None:
    """Importing the engine, in a fresh interpreter, loads no I/O, no gRPC, no store."""
    out = subprocess.run([sys.executable, "-c", _PURE], capture_output=True, text=True, timeout=60, cwd=REPO,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# Run in a fresh interpreter: import each module alone (the package's modules cleared
# before each), recording any import that reaches a module still being initialised.
_ISOLATED = textwrap.dedent(
    """
    import builtins, importlib, importlib.util, json, sys, traceback

    names = json.loads(sys.argv[1])
    ours = ("trialkeeper.coordinator", "trialkeeper.agent")
    cycles, failures = [], {}
    real_import = builtins.__import__

    def initializing(name):
        return getattr(getattr(sys.modules.get(name), "__spec__", None), "_initializing", False)

    def watching_import(name, globals=None, locals=None, fromlist=(), level=0):
        if globals is not None and level:
            target = importlib.util.resolve_name("." * level + name, globals.get("__package__") or "")
        else:
            target = name
        importer = (globals or {}).get("__name__", "?")
        subs = [f"{target}.{item}" for item in (fromlist or ()) if item != "*"]
        before = {m for m in [target, *subs] if initializing(m)}
        try:
            return real_import(name, globals, locals, fromlist, level)
        finally:
            # `from . import x` reaches the submodule x, not its package (which is still
            # initialising while its __init__ imports x); `from .m import name` reaches m.
            if subs and hasattr(sys.modules.get(target), "__path__"):
                reached = [s for s in subs if s in sys.modules]
                if len(reached) < len(subs):
                    reached.append(target)
            else:
                reached = [target]
            for module in reached:
                if module in before and module.startswith(ours) and module != importer:
                    cycles.append([importer, module])

    builtins.__import__ = watching_import
    for name in names:
        for loaded in [m for m in sys.modules if m.startswith(ours)]:
            del sys.modules[loaded]
        try:
            importlib.import_module(name)
        except BaseException:
            failures[name] = traceback.format_exc(limit=3)
    print(json.dumps({"cycles": cycles, "failures": failures}))
    """
)


def test_every_module_imports_on_its_own_without_a_cycle() -> None:
    out = subprocess.run(
        # __main__ modules are scripts: importing one runs it.
        [sys.executable, "-c", _ISOLATED, json.dumps(sorted(m for m in MODULES if not m.endswith(".__main__")))],
        capture_output=True, text=True, timeout=600, cwd=REPO, check=False,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["failures"] == {}
    assert report["cycles"] == []


_PARSE_ONE = textwrap.dedent(
    """
    import json, sys
    from trialkeeper.coordinator.config.experiment import parse_config

    section = {"platform": sys.argv[1], **json.loads(sys.argv[3])}
    cfg = parse_config({"trialCommand": "true", "trialConcurrency": 1, "trainingService": section},
                       sys.argv[2])
    print(json.dumps([type(cfg.training_service).__module__, sorted(sys.modules)]))
    """
)


@pytest.mark.parametrize(
    ("platform", "fields"), [("local", {}), ("kubernetes", {"image": "python:3.11"}), ("slurm", {})]
)
def test_a_config_imports_only_the_platform_it_names(platform: str, fields: dict[str, str], tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PARSE_ONE, platform, str(tmp_path), json.dumps(fields)],
        capture_output=True, text=True, timeout=60, cwd=REPO, check=False,
    )
    assert out.returncode == 0, out.stderr
    config_module, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    expected = {"kubernetes": "trialkeeper.coordinator.services.kubernetes.config"}
    assert config_module == expected.get(platform, f"trialkeeper.coordinator.services.{platform}_config")
    services = [m for m in loaded if m.startswith("trialkeeper.coordinator.services.")]
    its_own = {config_module, config_module.rpartition(".")[0]}
    others = [
        m
        for m in services
        if m not in its_own
        and any(word in m.removeprefix("trialkeeper.coordinator.services.") for word in PLATFORM_MODULE_WORDS)
    ]
    assert others == []
    # No SDK of any platform either, the named one's included: parsing needs none.
    assert not any(m.split(".")[0] in ("kubernetes", "ray", "paramiko", "azureml") for m in loaded)


_OLD_PATHS = textwrap.dedent(
    """
    import importlib, json, sys
    from trialkeeper.coordinator import _moved

    same = {}
    for old, new in _moved.MOVED.items():
        a = importlib.import_module(f"trialkeeper.coordinator.{old}")
        b = importlib.import_module(f"trialkeeper.coordinator.{new}")
        same[old] = a is b
    from trialkeeper.coordinator.configrules import Issues  # as plug-ins wrote it
    from trialkeeper.coordinator.config import ExperimentConfig, parse_config  # a package now
    print(json.dumps(same))
    """
)


def test_the_old_module_paths_still_import_as_the_new_modules() -> None:
    """Code written before the packages by layer (plug-ins, scripts) keeps importing."""
    out = subprocess.run([sys.executable, "-c", _OLD_PATHS], capture_output=True, text=True, timeout=60,
                         cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr
    same = json.loads(out.stdout.strip().splitlines()[-1])
    assert same and all(same.values()), [old for old, ok in same.items() if not ok]
