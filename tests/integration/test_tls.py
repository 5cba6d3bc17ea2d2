"""TLS: the coordinator serves with a per-experiment certificate that agents pin.

Real coordinators, real agent processes, real TLS on loopback. An impostor server with a
certificate of its own (same name, different key) stands in for a man in the middle.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
from pathlib import Path

import grpc
import psutil
from conftest import async_wait_until, build_config, run_async, write_script
from cryptography import x509
from trialkeeper.agent import tls as agent_tls
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus
from trialkeeper.coordinator.transport import tls
from trialkeeper.coordinator.transport.server import PROTOCOL_VERSION, TOKEN_METADATA_KEY
from trialkeeper.protos.v1 import coordinator_pb2 as pb
from trialkeeper.protos.v1 import coordinator_pb2_grpc as pb_grpc

WAIT_S = 30.0
RPC_TIMEOUT_S = 10.0
AGENT_EXIT_S = 30.0

TRIAL = """
from trialkeeper.agent import trial

x = trial.get_next_parameter()["x"]
trial.report_intermediate_result(x + 0.5)
trial.report_final_result(x * 2.0)
"""


def _tls_config(tmp_path: Path, **overrides: object):  # type: ignore[no-untyped-def]
    return build_config(tmp_path, coordinator={"tls": True}, **overrides)


def _token(c: Coordinator) -> str:
    return (c.experiment_dir / ".token").read_text()


def _register(env_id: str) -> pb.AgentMessage:
    return pb.AgentMessage(
        register=pb.Register(
            protocol_version=PROTOCOL_VERSION, environment_id=env_id, agent_instance_id="raw", pid=os.getpid()
        )
    )


def _pinned_channel(address: str, cert_pem: bytes) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(root_certificates=cert_pem)
    return grpc.aio.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", tls.SERVER_NAME)])


async def _first_answer(
    channel: grpc.aio.Channel, metadata: object, env_id: str
) -> tuple[grpc.StatusCode, str, object]:
    call = pb_grpc.CoordinatorStub(channel).Session(metadata=metadata, timeout=RPC_TIMEOUT_S)
    answer: object = None
    try:
        await call.write(_register(env_id))
        answer = await call.read()
    except (grpc.aio.AioRpcError, grpc.aio.UsageError):
        pass
    if answer is not None and answer is not grpc.aio.EOF:
        call.cancel()
        return grpc.StatusCode.OK, "", answer
    return await call.code(), (await call.details()) or "", answer


async def _run_agent(tmp_path: Path, address: str, token: str, env_id: str, *args: str) -> tuple[int, str]:
    """Run the agent CLI until it exits (it must, within the deadline); returns its status
    and output."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trialkeeper.agent",
        "--coordinator", address,
        "--environment-id", env_id,
        "--workdir", str(tmp_path / f"agent-{env_id}"),
        "--no-gpu",
        *args,
        env={**os.environ, "TRIALKEEPER_TOKEN": token},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), AGENT_EXIT_S)
    except asyncio.TimeoutError:
        proc.kill()
        out, _ = await proc.communicate()
        raise AssertionError(
            f"agent {env_id} did not exit within {AGENT_EXIT_S} s:\n{out.decode(errors='replace')}"
        ) from None
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


def test_tls_end_to_end_with_real_agents(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", TRIAL)
    config = _tls_config(tmp_path)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            fp = c.tls_fingerprint
            assert fp is not None and len(fp) == 64
            # Key and certificate in the experiment directory, readable by the owner only.
            for name in (tls.KEY_FILE, tls.CERT_FILE):
                mode = stat.S_IMODE((c.experiment_dir / name).stat().st_mode)
                assert mode == 0o600, (name, oct(mode))
            cert_pem = (c.experiment_dir / tls.CERT_FILE).read_bytes()
            assert tls.fingerprint(cert_pem) == agent_tls.certificate_fingerprint(cert_pem) == fp
            # A resumed coordinator finds the same identity, so pinned agents reconnect.
            assert tls.load_or_create(c.experiment_dir).fingerprint == fp
            cert = x509.load_pem_x509_certificate(cert_pem)
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            assert san.get_values_for_type(x509.DNSName) == [tls.SERVER_NAME]
            assert agent_tls.SERVER_NAME == tls.SERVER_NAME

            handles = [await c.submit({"x": x}) for x in range(4)]
            infos = [await h.wait(WAIT_S) for h in handles]
            assert [i.status for i in infos] == [TrialStatus.SUCCEEDED] * 4, [(i.status, i.reason) for i in infos]
            assert [i.final_metric for i in infos] == [0.0, 2.0, 4.0, 6.0]
            assert c.store is not None
            for x, h in enumerate(handles):
                assert [(r.kind, r.value) for r in c.store.metrics(h.id)] == [
                    ("intermediate", x + 0.5),
                    ("final", x * 2.0),
                ]

            # The agents were launched with the fingerprint (not secret) and without the token.
            token = _token(c)
            agents = [e for e in c.environments() if e.status in (EnvStatus.READY, EnvStatus.BUSY)]
            assert len(agents) == 2
            for row in c.store.envs():
                argv = psutil.Process(json.loads(row["info_json"])["pid"]).cmdline()
                assert argv[argv.index("--tls-fingerprint") + 1] == fp, argv
                assert token not in " ".join(argv)
            log_text = "".join(p.read_text() for p in (c.experiment_dir / "envs").glob("*/agent.log"))
            assert "presented the pinned TLS certificate" in log_text
            assert token not in log_text

    run_async(body)


def test_tls_coordinator_refuses_plaintext_wrong_pins_and_wrong_tokens(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", TRIAL)
    config = _tls_config(tmp_path, trialConcurrency=1)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            token = _token(c)
            cert_pem = (c.experiment_dir / tls.CERT_FILE).read_bytes()
            assert c.tls_fingerprint is not None
            other = tls.load_or_create(tmp_path / "other")
            cert_file = tmp_path / "pinned.pem"
            cert_file.write_bytes(cert_pem)
            plaintext, wrong_pin = await asyncio.gather(
                _run_agent(tmp_path, c.address, token, "plain"),
                _run_agent(tmp_path, c.address, token, "wrong-pin", "--tls-fingerprint", other.fingerprint),
            )
            # A plain-text agent: refused at once, with a message that names TLS.
            code, out = plaintext
            assert code == 2, out
            assert "requires TLS" in out and "--tls-fingerprint" in out, out
            # An agent pinning another certificate: refused before it sends anything.
            code, out = wrong_pin
            assert code == 2, out
            assert "TLS" in out and "fingerprint" in out and c.tls_fingerprint in out, out
            assert "refusing to connect" in out, out
            ids = {e.id for e in c.environments()}
            assert not ids & {"plain", "wrong-pin"}, ids

            # Under TLS the token is still required, on every stream.
            async with _pinned_channel(c.address, cert_pem) as channel:
                for metadata in (None, ((TOKEN_METADATA_KEY, "wrong"),), ((TOKEN_METADATA_KEY, token[:-1]),)):
                    status, details, _ = await _first_answer(channel, metadata, "raw-tls")
                    assert status is grpc.StatusCode.UNAUTHENTICATED, (metadata, status, details)
                status, details, answer = await _first_answer(channel, ((TOKEN_METADATA_KEY, token),), "raw-tls")
                assert status is grpc.StatusCode.OK and answer.HasField("welcome"), (status, details)  # type: ignore[union-attr]

            # --tls-cert is an equivalent pin: an agent given the certificate file joins.
            # Draining at once (SIGTERM) makes it leave again after registering.
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "trialkeeper.agent",
                "--coordinator", c.address, "--environment-id", "by-file",
                "--workdir", str(tmp_path / "agent-by-file"), "--no-gpu", "--tls-cert", str(cert_file),
                env={**os.environ, "TRIALKEEPER_TOKEN": token},
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )
            try:
                await async_wait_until(
                    lambda: any(e.id == "by-file" and e.connected for e in c.environments()), WAIT_S,
                    message="the agent pinned by --tls-cert did not register",
                )
                proc.terminate()
                assert await asyncio.wait_for(proc.wait(), AGENT_EXIT_S) == 0
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()

            # The coordinator kept serving: a trial still runs to its end.
            info = await (await c.submit({"x": 3})).wait(WAIT_S)
            assert info.status is TrialStatus.SUCCEEDED and info.final_metric == 6.0, (info.status, info.reason)

    run_async(body)


class _Impostor(grpc.GenericRpcHandler):
    """A TLS server with its own certificate for the coordinator's name; records what it is sent."""

    def __init__(self) -> None:
        self.metadata: list[object] = []

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        self.metadata.append(handler_call_details.invocation_metadata)
        return None  # type: ignore[return-value]  # UNIMPLEMENTED


def test_man_in_the_middle_is_refused_and_learns_no_token(tmp_path: Path) -> None:
    """The agent knows the real coordinator's pin but reaches a server with another
    certificate: with --tls-fingerprint it refuses before any RPC; with --tls-cert the TLS
    handshake fails. Either way the impostor never sees the token."""
    real = tls.load_or_create(tmp_path / "real")
    fake = tls.load_or_create(tmp_path / "fake")
    real_cert = tmp_path / "real.pem"
    real_cert.write_bytes(real.cert_pem)

    async def body() -> None:
        impostor = _Impostor()
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((impostor,))
        port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([fake.key_cert]))
        await server.start()
        try:
            address = f"127.0.0.1:{port}"
            token = "t" * 43
            (code, out), (code2, out2) = await asyncio.gather(
                _run_agent(tmp_path, address, token, "mitm-fp", "--tls-fingerprint", real.fingerprint),
                _run_agent(
                    tmp_path, address, token, "mitm-cert", "--tls-cert", str(real_cert), "--reconnect-window", "1"
                ),
            )
            assert code == 2, out
            assert fake.fingerprint in out and real.fingerprint in out and "refusing to connect" in out, out
            assert code2 != 0, out2
            assert "CERTIFICATE_VERIFY_FAILED" in out2 or "handshake" in out2.lower(), out2
            assert impostor.metadata == [], impostor.metadata
        finally:
            await server.stop(None)

    run_async(body)


def test_tls_agent_against_a_plaintext_coordinator_says_so(tmp_path: Path) -> None:
    config = build_config(tmp_path, trialConcurrency=1)
    other = tls.load_or_create(tmp_path / "other")

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            assert c.tls_fingerprint is None
            assert not (c.experiment_dir / tls.KEY_FILE).exists()
            code, out = await _run_agent(
                tmp_path, c.address, _token(c), "tls-agent", "--tls-fingerprint", other.fingerprint
            )
            assert code == 2, out
            assert "does not speak TLS" in out, out

    run_async(body)


def test_fingerprint_formats() -> None:
    fp = "ab" * 32
    assert agent_tls.normalize_fingerprint(":".join(["AB"] * 32)) == fp
    assert agent_tls.normalize_fingerprint(f"sha256:{fp.upper()}") == fp
    for bad in ("", "ab" * 31, "zz" * 32, "ab" * 33):
        try:
            agent_tls.normalize_fingerprint(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad!r}")
