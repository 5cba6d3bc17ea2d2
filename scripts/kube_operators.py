#!/usr/bin/env python3
"""Build the Kubernetes operators the Kubernetes platform tests run against, and cache them.

    python scripts/kube_operators.py build    # build what is missing (cold: a few minutes)
    python scripts/kube_operators.py path     # print where each operator's files are

Each operator is built from its Go module at a pinned version (through the Go module
proxy) with a small main of ours (``scripts/kube_operators/<name>/main.go``) that runs the
operator's own controllers and webhooks as a local process against a loopback API server.
What a test needs of it lands in ``~/.cache/trialkeeper/kube/operators/<name>-<version>/``:
the stripped binary and the operator's own manifests (its CRDs, its webhook
configuration), copied from the module. A lock file makes a second caller wait for the
first build instead of building again; a finished build is reused while our main is
unchanged (its hash is stored beside the binary).

AdaptDL's scheduler is a Python package (``adaptdl-sched``): it gets a virtual environment
of its own in ``~/.cache/trialkeeper/kube/operators/adaptdl-sched-<version>/venv``, since it
pins an old aiohttp and kubernetes-asyncio that the project's own environment must not get.

FrameworkController is not here: no registry serves its source (the Go module proxy refuses
``github.com/microsoft/frameworkcontroller``, 403), so nothing here builds it. Given a binary
of it (``TRIALKEEPER_FRAMEWORKCONTROLLER``), tests/kube/operators.py runs it on the test
cluster; otherwise its tests keep the fake API server of tests/fake_k8s.py.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
GO_VERSION_LINE = "go 1.23"


@dataclass(frozen=True)
class Operator:
    name: str
    module: str
    version: str
    # Files of the module a test applies, relative to the module root.
    manifests: tuple[str, ...]

    @property
    def source(self) -> Path:
        return HERE / "kube_operators" / self.name / "main.go"


TRAINING_OPERATOR = Operator(
    name="training-operator",
    module="github.com/kubeflow/training-operator",
    version="v1.9.2",
    manifests=(
        "manifests/base/crds/kubeflow.org_tfjobs.yaml",
        "manifests/base/crds/kubeflow.org_pytorchjobs.yaml",
        "manifests/base/webhook/manifests.yaml",
    ),
)
OPERATORS: tuple[Operator, ...] = (TRAINING_OPERATOR,)


@dataclass(frozen=True)
class PythonScheduler:
    name: str
    version: str
    # Pins beyond the package's own: releases its code was written against.
    extra: tuple[str, ...] = ()

    @property
    def requirements(self) -> list[str]:
        return [f"{self.name}=={self.version}", *self.extra]


# adaptdl-sched asks for pymoo>=0.5.0 and numpy>=1.17, but imports a module pymoo 0.6 removed
# and (in its allocator's policy) uses numpy.int, which numpy 1.24 removed.
ADAPTDL_SCHED = PythonScheduler(name="adaptdl-sched", version="0.2.11", extra=("pymoo==0.5.0", "numpy<1.24"))


def cache_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "trialkeeper" / "kube" / "operators"


def operator_dir(op: Operator) -> Path:
    return cache_root() / f"{op.name}-{op.version}"


def binary(op: Operator) -> Path:
    return operator_dir(op) / op.name


def manifest(op: Operator, relative: str) -> Path:
    return operator_dir(op) / "manifests" / Path(relative).name


def scheduler_python(sched: PythonScheduler) -> Path:
    return cache_root() / f"{sched.name}-{sched.version}" / "venv" / "bin" / "python"


def scheduler_installed(sched: PythonScheduler) -> bool:
    """Installed, with the pins of this script (a changed pin installs again)."""
    record = scheduler_python(sched).parent.parent / "requirements.txt"
    return record.is_file() and record.read_text() == "\n".join(sched.requirements) + "\n"


def _stamp(op: Operator) -> str:
    return hashlib.sha256(f"{op.module}@{op.version}\n".encode() + op.source.read_bytes()).hexdigest()


def is_built(op: Operator) -> bool:
    stamp = operator_dir(op) / "stamp"
    return binary(op).is_file() and stamp.is_file() and stamp.read_text().strip() == _stamp(op)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"another build holds {path}; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _say(text: str) -> None:
    print(f"[kube-operators] {text}", file=sys.stderr, flush=True)


def _go(args: list[str], cwd: Path) -> str:
    go = shutil.which("go")
    if go is None:
        raise SystemExit("the operators are built with Go (https://go.dev/dl/): `go` is not on PATH")
    env = {**os.environ, "GOFLAGS": "-mod=mod", "CGO_ENABLED": "0"}
    done = subprocess.run([go, *args], cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"`go {' '.join(args)}` failed in {cwd}:\n{done.stderr[-4000:]}")
    return done.stdout


def build(op: Operator) -> Path:
    """The operator's binary, built unless a build of this version and main is cached."""
    out = operator_dir(op)
    with _locked(cache_root() / f".{op.name}.lock"):
        if is_built(op):
            return binary(op)
        began = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"tk-{op.name}-") as tmp:
            work = Path(tmp)
            shutil.copy(op.source, work / "main.go")
            (work / "go.mod").write_text(
                f"module trialkeeper.local/{op.name}\n\n{GO_VERSION_LINE}\n\nrequire {op.module} {op.version}\n"
            )
            _say(f"{op.name} {op.version}: fetching the module and its dependencies")
            info = json.loads(_go(["mod", "download", "-json", f"{op.module}@{op.version}"], work))
            module_dir = Path(info["Dir"])
            # The operator's own go.sum pins what it was released with; tidy adds only what is missing.
            shutil.copyfile(module_dir / "go.sum", work / "go.sum")
            _go(["mod", "tidy"], work)
            _say(f"{op.name} {op.version}: compiling (a few minutes from a cold Go build cache)")
            staged = out.with_name(out.name + ".new")
            shutil.rmtree(staged, ignore_errors=True)
            (staged / "manifests").mkdir(parents=True)
            _go(["build", "-trimpath", "-ldflags", "-s -w", "-o", str(staged / op.name), "."], work)
            for relative in op.manifests:
                shutil.copyfile(module_dir / relative, staged / "manifests" / Path(relative).name)
            (staged / "stamp").write_text(_stamp(op) + "\n")
            shutil.rmtree(out, ignore_errors=True)
            staged.rename(out)
        _say(f"{op.name} {op.version}: built in {time.monotonic() - began:.0f} s -> {binary(op)}")
        return binary(op)


def build_scheduler(sched: PythonScheduler) -> Path:
    """The interpreter of a virtual environment with ``sched`` installed, made unless cached."""
    python = scheduler_python(sched)
    venv = python.parent.parent
    wanted = "\n".join(sched.requirements) + "\n"
    with _locked(cache_root() / f".{sched.name}.lock"):
        if scheduler_installed(sched):
            return python
        began = time.monotonic()
        _say(f"{sched.name} {sched.version}: installing into {venv} (a few minutes: it compiles an old aiohttp)")
        staged = venv.with_name("venv.new")
        shutil.rmtree(staged, ignore_errors=True)
        # The same interpreter as the tests' own: its packages' wheels match it.
        subprocess.run([sys.executable, "-m", "venv", str(staged)], check=True, timeout=300)
        done = subprocess.run([str(staged / "bin" / "python"), "-m", "pip", "install", "-q", *sched.requirements],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800, check=False)
        if done.returncode != 0:
            raise SystemExit(f"pip install {' '.join(sched.requirements)} failed:\n{done.stdout[-4000:]}")
        (staged / "requirements.txt").write_text(wanted)
        shutil.rmtree(venv, ignore_errors=True)
        staged.rename(venv)
        _say(f"{sched.name} {sched.version}: installed in {time.monotonic() - began:.0f} s")
        return python


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("build", "path"), nargs="?", default="build")
    args = parser.parse_args(argv)
    for op in OPERATORS:
        if args.command == "build":
            build(op)
        print(f"{op.name} {op.version} {operator_dir(op)}{'' if is_built(op) else ' (not built)'}")
    if args.command == "build":
        build_scheduler(ADAPTDL_SCHED)
    installed = scheduler_installed(ADAPTDL_SCHED)
    print(
        f"{ADAPTDL_SCHED.name} {ADAPTDL_SCHED.version} {scheduler_python(ADAPTDL_SCHED).parent.parent}"
        f"{'' if installed else ' (not built)'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
