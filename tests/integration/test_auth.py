"""The coordinator refuses agents with a wrong or missing token, or another protocol."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import grpc
from conftest import build_config, run_async
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.transport.server import PROTOCOL_VERSION, TOKEN_METADATA_KEY
from trialkeeper.protos.v1 import coordinator_pb2 as pb
from trialkeeper.protos.v1 import coordinator_pb2_grpc as pb_grpc

RPC_TIMEOUT_S = 10.0


def _register(protocol_version: int = PROTOCOL_VERSION, env_id: str = "manual-1") -> pb.AgentMessage:
    return pb.AgentMessage(
        register=pb.Register(
            protocol_version=protocol_version,
            environment_id=env_id,
            agent_instance_id="test-instance",
            hostname="test",
            pid=os.getpid(),
        )
    )


async def _open_session(
    address: str, metadata: tuple[tuple[str, str], ...] | None, first: pb.AgentMessage
) -> tuple[grpc.StatusCode, str, object]:
    """Open a raw Session stream, send ``first``, read one answer; returns the call's final
    status code, its details and the message read (EOF when the stream ended)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        call = stub.Session(metadata=metadata, timeout=RPC_TIMEOUT_S)
        answer: object = None
        try:
            await call.write(first)
            answer = await call.read()
        except grpc.aio.AioRpcError:
            pass
        except grpc.aio.UsageError:
            pass  # writing after the server ended the call
        code = await call.code()
        details = await call.details()
        return code, details or "", answer


def _coordinator(tmp_path: Path) -> Coordinator:
    # One environment is enough; the tests talk to the server beside it.
    return Coordinator(build_config(tmp_path, trialConcurrency=1), experiment_dir=tmp_path / "exp")


def _token(c: Coordinator) -> str:
    return (c.experiment_dir / ".token").read_text()


def test_wrong_or_missing_token_is_unauthenticated(tmp_path: Path) -> None:
    async def body() -> None:
        async with _coordinator(tmp_path) as c:
            assert len(_token(c)) >= 32
            for metadata in (((TOKEN_METADATA_KEY, "wrong"),), None, ((TOKEN_METADATA_KEY, _token(c) + "x"),)):
                code, details, answer = await _open_session(c.address, metadata, _register())
                assert code is grpc.StatusCode.UNAUTHENTICATED, (metadata, code, details)
                assert "token" in details
                assert answer is None or answer is grpc.aio.EOF
            # The refused streams created no environment.
            assert "manual-1" not in {e.id for e in c.environments()}

    run_async(body)


def test_wrong_protocol_version_is_failed_precondition(tmp_path: Path) -> None:
    async def body() -> None:
        async with _coordinator(tmp_path) as c:
            metadata = ((TOKEN_METADATA_KEY, _token(c)),)
            code, details, _ = await _open_session(
                c.address, metadata, _register(protocol_version=PROTOCOL_VERSION + 1)
            )
            assert code is grpc.StatusCode.FAILED_PRECONDITION, (code, details)
            assert "protocol version" in details
            assert "manual-1" not in {e.id for e in c.environments()}

    run_async(body)


def test_correct_token_gets_a_welcome(tmp_path: Path) -> None:
    """The positive control for the refusals above: the same raw stream, done right."""

    async def body() -> None:
        async with _coordinator(tmp_path) as c:
            metadata = ((TOKEN_METADATA_KEY, _token(c)),)
            async with grpc.aio.insecure_channel(c.address) as channel:
                call = pb_grpc.CoordinatorStub(channel).Session(metadata=metadata, timeout=RPC_TIMEOUT_S)
                await call.write(_register(env_id="manual-ok"))
                answer = await call.read()
                assert answer is not grpc.aio.EOF and answer.HasField("welcome"), answer
                assert answer.welcome.experiment_id == c.experiment_id
                assert answer.welcome.protocol_version == PROTOCOL_VERSION
                assert "manual-ok" in {e.id for e in c.environments()}
                call.cancel()

    run_async(body)


async def _run_agent_cli(tmp_path: Path, address: str, token: str, env_id: str = "x") -> tuple[int, str]:
    """Run the real agent CLI against ``address``; it must exit within the deadline (a
    refused agent exits at once instead of retrying for its reconnect window)."""
    env = {**os.environ, "TRIALKEEPER_TOKEN": token}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trialkeeper.agent",
        "--coordinator", address,
        "--environment-id", env_id,
        "--workdir", str(tmp_path / "cli-agent"),
        "--no-gpu",
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 30.0)
    except asyncio.TimeoutError:
        proc.kill()
        out, _ = await proc.communicate()
        raise AssertionError(
            "the refused agent did not exit within 30 s (it retried instead):\n" + out.decode(errors="replace")
        ) from None
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


def test_agent_cli_with_wrong_token_exits_with_the_refusal(tmp_path: Path) -> None:
    async def body() -> None:
        async with _coordinator(tmp_path) as c:
            code, text = await _run_agent_cli(tmp_path, c.address, "wrong")
            assert code != 0, text
            assert "refused" in text and "token" in text, text
            assert "UNAUTHENTICATED" in text, text
            assert "x" not in {e.id for e in c.environments()}

    run_async(body)


def test_agent_cli_for_an_unknown_environment_without_reuse_exits(tmp_path: Path) -> None:
    """Right token, but a coordinator without reuse mode takes no hand-started agents:
    FAILED_PRECONDITION is a refusal too, and the agent exits instead of retrying."""
    config = build_config(tmp_path, trialConcurrency=1, trainingService={"reuseMode": False})

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            code, text = await _run_agent_cli(tmp_path, c.address, _token(c), env_id="hand-started")
            assert code != 0, text
            assert "FAILED_PRECONDITION" in text and "unknown environment" in text, text
            assert "hand-started" not in {e.id for e in c.environments()}

    run_async(body)
