"""The committed protobuf code matches the .proto (scripts/gen_protos --check)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_protos"

try:
    import grpc_tools  # noqa: F401

    HAVE_GRPC_TOOLS = True
except ImportError:
    HAVE_GRPC_TOOLS = False

needs_grpc_tools = pytest.mark.skipif(
    not HAVE_GRPC_TOOLS, reason="grpcio-tools is not installed (pip install -e '.[dev]'); cannot regenerate protos"
)


def _load_script() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("gen_protos_under_test", str(SCRIPT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@needs_grpc_tools
def test_committed_code_is_up_to_date() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, f"scripts/gen_protos --check failed:\n{proc.stdout}\n{proc.stderr}"
    assert "up to date" in proc.stdout


@needs_grpc_tools
def test_check_reports_a_changed_proto_as_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "protos"
    shutil.copytree(ROOT / "protos", copy, ignore=shutil.ignore_patterns("__pycache__"))
    proto = copy / "v1" / "coordinator.proto"
    text = proto.read_text()
    marker = "message Ack {"
    assert marker in text, "the test expects an Ack message to extend"
    proto.write_text(text.replace(marker, marker + "\n  string added_by_test = 99;", 1))
    originals = {p.name: p.read_bytes() for p in (ROOT / "protos" / "v1").iterdir() if p.is_file()}

    gen = _load_script()
    monkeypatch.setattr(gen, "PROTO_DIR", copy)
    monkeypatch.setattr(sys, "argv", ["gen_protos", "--check"])
    assert gen.main() == 1
    err = capsys.readouterr().err
    assert "stale" in err and "coordinator_pb2.py" in err

    # The unmodified copy is up to date, so it was the edit that made it stale.
    shutil.copy(ROOT / "protos" / "v1" / "coordinator.proto", proto)
    assert gen.main() == 0
    # --check wrote nothing, neither into the copy nor into the repository.
    assert {p.name: p.read_bytes() for p in (ROOT / "protos" / "v1").iterdir() if p.is_file()} == originals


def test_generated_modules_import() -> None:
    from trialkeeper.protos.v1 import coordinator_pb2 as pb
    from trialkeeper.protos.v1 import coordinator_pb2_grpc as pb_grpc

    assert hasattr(pb_grpc, "CoordinatorStub")
    msg = pb.AgentMessage(seq=3, register=pb.Register(protocol_version=1, environment_id="e"))
    assert pb.AgentMessage.FromString(msg.SerializeToString()) == msg


def _uint64_paths(desc: object, prefix: str = "") -> set[str]:
    from google.protobuf.descriptor import FieldDescriptor

    out: set[str] = set()
    for f in desc.fields:  # type: ignore[attr-defined]
        if f.type == FieldDescriptor.TYPE_UINT64:
            out.add(prefix + f.name)
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            out |= _uint64_paths(f.message_type, f"{prefix}{f.name}.")
    return out


def test_the_written_out_heartbeat_check_covers_every_uint64_field() -> None:
    # The edge checks heartbeats as it converts them (wire.heartbeat); a uint64 field added
    # to Heartbeat (or a message in it) must be checked there too.
    from trialkeeper.coordinator.transport import wire
    from trialkeeper.coordinator.transport.server import MAX_SEQ, _out_of_range
    from trialkeeper.protos.v1 import coordinator_pb2 as pb

    paths = _uint64_paths(pb.Heartbeat.DESCRIPTOR)
    assert paths == {"memory_used_bytes", "gpus.memory_used_bytes", "gpus.processes.used_memory_bytes"}, paths
    for path in sorted(paths):
        hb = pb.Heartbeat(
            gpus=[
                pb.GpuSample(uuid="a"),
                pb.GpuSample(uuid="b", processes=[pb.GpuProcess(pid=1), pb.GpuProcess(pid=2)]),
            ]
        )
        target: object = hb
        *parents, name = path.split(".")
        for part in parents:
            target = getattr(target, part)[-1]
        setattr(target, name, MAX_SEQ + 1)
        refusal = wire.heartbeat("env-1", 1, hb)
        assert refusal == f"Heartbeat.{_out_of_range(hb)} is out of range", (path, refusal)
        setattr(target, name, MAX_SEQ)
        assert _out_of_range(hb) == "" and not isinstance(wire.heartbeat("env-1", 1, hb), str), path
