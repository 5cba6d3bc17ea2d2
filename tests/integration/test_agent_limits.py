"""What a trial cannot make its agent do: hold its output in memory, leave daemons running,
leave sockets behind."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
from conftest import async_wait_until, build_config, run_async, write_script
from netproxy import CuttingProxy
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.events import AgentReported, LogReported
from trialkeeper.coordinator.engine.model import EnvStatus, TrialStatus
from trialkeeper.coordinator.services.base import (
    EnvironmentRequest,
    EnvironmentService,
    Observation,
    StartResult,
)

WAIT_S = 60.0
OUTPUT_MIB = 400
# What the agent may grow by while a trial writes OUTPUT_MIB (issue 19: "under 150 MiB").
RSS_GROWTH_LIMIT = 150 * 1024 * 1024

# Each MiB of output names its own number, so a chunk stored at the wrong offset shows.
BURST = f"""
import sys
out = sys.stdout.buffer
for i in range({OUTPUT_MIB}):
    out.write(("%08d" % i).encode() * (1 << 17))
out.flush()
"""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


class _OwnDiskAgents(EnvironmentService):
    """A platform whose agents keep their files to themselves, as on another machine: they
    stream their trials' logs. Each is a real agent process with a work dir of its own."""

    platform = "own-disk"
    shares_filesystem = False

    def __init__(self, root: Path, code: Path) -> None:
        self.root, self.code = root, code
        self.procs: dict[str, asyncio.subprocess.Process] = {}

    def working_directory(self) -> str:
        return str(self.code)

    async def start(self, request: EnvironmentRequest) -> StartResult:
        if request.env_id not in self.procs:
            self.procs[request.env_id] = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "trialkeeper.agent", "--coordinator", request.coordinator_address,
                "--environment-id", request.env_id, "--workdir", str(self.root / request.env_id), "--no-gpu",
                *request.agent_args,
                env={**os.environ, "TRIALKEEPER_TOKEN": request.token},
                stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True,
            )
        return StartResult(platform_id=f"pid {self.procs[request.env_id].pid}")

    async def poll(self, env_ids: Sequence[str]) -> dict[str, Observation]:
        out = {}
        for env_id in env_ids:
            proc = self.procs.get(env_id)
            state = "unknown" if proc is None else "running" if proc.returncode is None else "exited"
            out[env_id] = Observation(state)  # type: ignore[arg-type]
        return out

    async def stop(self, env_id: str, grace_s: float = 5.0) -> None:
        proc = self.procs.get(env_id)
        if proc is None or proc.returncode is not None:
            return
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()


class _PeakRss:
    """The highest resident set size of one process, polled until stopped."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = 0
        self._task: asyncio.Task[None] | None = None

    def rss(self) -> int:
        try:
            return int(self.proc.memory_info().rss)
        except psutil.Error:
            return 0

    async def _poll(self) -> None:
        while True:
            self.peak = max(self.peak, self.rss())
            await asyncio.sleep(0.01)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll())

    def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()


def _counting_log_chunks(c: Coordinator) -> Callable[[], int]:
    """Count the LogChunks that reach the coordinator's core, whoever sent them."""
    seen = [0]
    assert c._shell is not None
    handle = c._shell.agent_event

    def counted(event: Any, link: Any) -> None:
        if isinstance(event, AgentReported) and isinstance(event.report, LogReported):
            seen[0] += 1
        handle(event, link)

    c._shell.agent_event = counted  # type: ignore[method-assign]
    return lambda: seen[0]


def test_an_output_burst_is_streamed_from_disk_with_bounded_agent_memory(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", BURST)
    config = build_config(tmp_path, trialConcurrency=1)
    service = _OwnDiskAgents(tmp_path / "agents", tmp_path)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp", service=service) as c:
            chunks = _counting_log_chunks(c)
            env = await async_wait_until(
                lambda: next((e for e in c.environments() if e.hostname), None), WAIT_S, message="no agent registered"
            )
            rss = _PeakRss(service.procs[env.id].pid)
            idle = rss.rss()
            rss.start()
            try:
                handle = await c.submit({})
                info = await handle.wait(WAIT_S)
            finally:
                rss.stop()
            assert info.status is TrialStatus.SUCCEEDED, (info.status, info.reason)
            sent = tmp_path / "agents" / env.id / "trials" / handle.id / "stdout.log"
            got = c.experiment_dir / "trials" / handle.id / "stdout.log"
            assert sent.stat().st_size == OUTPUT_MIB << 20
            # Every chunk was stored before the trial's end, which was sent after them.
            assert got.stat().st_size == sent.stat().st_size
            assert _sha256(got) == _sha256(sent)
            assert chunks() >= OUTPUT_MIB * 4  # 256 KiB each
            growth = rss.peak - idle
            assert growth < RSS_GROWTH_LIMIT, f"the agent grew by {growth >> 20} MiB (idle {idle >> 20} MiB)"

    run_async(body)


# Output written over a couple of seconds, in pieces of uneven size.
STEADY = """
import sys, time
out = sys.stdout.buffer
for i in range(60):
    out.write(("%06d" % i).encode() * (50_000 + 997 * i))
    out.flush()
    time.sleep(0.03)
"""


def test_output_is_sent_again_from_the_file_after_connections_are_cut(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", STEADY)

    async def body() -> None:
        proxy = await CuttingProxy().start()
        config = build_config(
            tmp_path, trialConcurrency=1,
            coordinator={"advertiseAddress": f"127.0.0.1:{proxy.port}", "reconnectWindow": 30},
        )
        service = _OwnDiskAgents(tmp_path / "agents", tmp_path)
        stop = asyncio.Event()

        async def cut_now_and_then() -> None:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), 0.25)
                except asyncio.TimeoutError:
                    proxy.cut()

        try:
            async with Coordinator(config, experiment_dir=tmp_path / "exp", service=service) as c:
                assert c.store is not None
                host, port = str(c.store.meta("bound_address")).rsplit(":", 1)
                proxy.target = (host, int(port))
                handle = await c.submit({})
                await async_wait_until(lambda: handle.info.status is TrialStatus.RUNNING, WAIT_S, message="never ran")
                cutter = asyncio.ensure_future(cut_now_and_then())
                try:
                    info = await handle.wait(WAIT_S)
                finally:
                    stop.set()
                    await cutter
                assert info.status is TrialStatus.SUCCEEDED, (info.status, info.reason)
                assert proxy.cuts >= 3, f"only {proxy.cuts} cuts: the test did not test anything"
                sent = tmp_path / "agents" / info.environment_id / "trials" / handle.id / "stdout.log"
                got = c.experiment_dir / "trials" / handle.id / "stdout.log"
                assert got.stat().st_size == sent.stat().st_size
                assert _sha256(got) == _sha256(sent)
        finally:
            await proxy.close()

    run_async(body)


def test_local_agents_send_no_log_chunks(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", "import sys\nprint('to stdout ' * 1000)\nprint('to stderr', file=sys.stderr)\n")
    config = build_config(tmp_path, trialConcurrency=1)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            chunks = _counting_log_chunks(c)
            handles = [await c.submit({}) for _ in range(2)]
            for h in handles:
                info = await h.wait(WAIT_S)
                assert info.status is TrialStatus.SUCCEEDED, (info.status, info.reason)
                # The coordinator reads the files the agent's trials wrote, in place.
                trial_dir = c.experiment_dir / "trials" / h.id
                assert (trial_dir / "stdout.log").read_text() == "to stdout " * 1000 + "\n"
                assert (trial_dir / "stderr.log").read_text() == "to stderr\n"
            assert chunks() == 0

    run_async(body)


# Two daemons that leave the trial's process group for good (double fork, setsid) and
# ignore SIGTERM; the second also clears its environment, so nothing names its trial.
DAEMONS = """
import os, signal, sys, time

def daemon(pid_file, clear_env):
    if os.fork():
        return
    os.setsid()
    if os.fork():
        os._exit(0)
    if clear_env:
        code = "import os, signal, time\\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
        code += (
            f"open({pid_file + '.tmp'!r}, 'w').write(str(os.getpid()))\\n"
            f"os.rename({pid_file + '.tmp'!r}, {pid_file!r})\\n"
        )
        code += "while True: time.sleep(1)\\n"
        os.execve(sys.executable, [sys.executable, "-c", code], {})
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(pid_file + ".tmp", pid_file)
    while True:
        time.sleep(1)

for i, clear in enumerate((False, True)):
    daemon(os.path.join(sys.argv[1], f"daemon-{i}.pid"), clear)
    os.wait()
deadline = time.monotonic() + 60
for i in range(2):  # the trial ends once both daemons run and ignore SIGTERM
    while not os.path.exists(os.path.join(sys.argv[1], f"daemon-{i}.pid")) and time.monotonic() < deadline:
        time.sleep(0.01)
"""


def test_daemons_a_trial_leaves_behind_are_ended_with_it(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", DAEMONS)
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    config = build_config(tmp_path, trialConcurrency=1, trialCommand=f"python trial.py {pids_dir}")

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            await run_daemons_trial(c, pids_dir)
            assert c.environments()[0].status is not EnvStatus.FAILED

    run_async(body)


async def run_daemons_trial(c: Coordinator, pids_dir: Path) -> None:
    """Run one DAEMONS trial; its daemons must be gone, and reaped (not left as zombies),
    by the time its end is known."""
    info = await (await c.submit({})).wait(WAIT_S)
    assert info.status is TrialStatus.SUCCEEDED, (info.status, info.reason, info.stderr_tail)
    pids = [int((pids_dir / f"daemon-{i}.pid").read_text()) for i in range(2)]
    await async_wait_until(
        lambda: not any(psutil.pid_exists(pid) for pid in pids), 10.0,
        message=f"daemons still there: {[(pid, _state(pid)) for pid in pids]}",
    )


def _state(pid: int) -> str:
    try:
        p = psutil.Process(pid)
        return f"{p.status()}, parent {p.ppid()}"
    except psutil.Error:
        return "gone"


# Reports a metric, then says where its socket was, and what another user could do there.
REPORTER = """
import os, socket, sys
from trialkeeper.agent import trial

trial.report_intermediate_result(1.5)
name = os.environ["TRIALKEEPER_SOCKET"]
other_user = "not tried"
if os.getuid() == 0 and name.startswith("@"):
    # An abstract socket has no file mode: another user reaches it, and the agent must
    # refuse what it sends by its credentials.
    if os.fork() == 0:
        os.setuid(65534)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        line = '{"trial": "%s", "kind": "intermediate", "value": 99.0}' % os.environ["TRIALKEEPER_TRIAL_ID"]
        s.sendto(line.encode(), trial.socket_address(name))
        os._exit(0)
    other_user = "sent" if os.wait()[1] == 0 else "failed"
trial.report_final_result(2.5)
open(sys.argv[1], "w").write(name + "\\n" + other_user)
"""


def test_a_long_work_dir_leaves_no_socket_behind_after_kill_9(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", REPORTER)
    seen = tmp_path / "socket-name"
    config = build_config(tmp_path, trialConcurrency=1, trialCommand=f"python trial.py {seen}")
    # <root>/<env id>/sockets/<env id>.sock is then too long for a Unix socket's path.
    root = tmp_path / ("a-long-directory-name-" * 4)
    service = _OwnDiskAgents(root, tmp_path)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp", service=service) as c:
            info = await (await c.submit({})).wait(WAIT_S)
            assert info.status is TrialStatus.SUCCEEDED, (info.status, info.reason, info.stderr_tail)
            assert c.store is not None
            assert [(m.kind, m.value) for m in c.store.metrics(info.id)] == [("intermediate", 1.5), ("final", 2.5)]
            name, other_user = seen.read_text().split("\n")
            assert other_user == ("sent" if os.getuid() == 0 else "not tried")
            assert name.startswith("@trialkeeper-"), name
            agent = service.procs[info.environment_id]
            bound = [s.laddr for s in psutil.Process(agent.pid).net_connections("unix")]
            assert "\0" + name[1:] in bound or name in bound, bound
            assert not any(isinstance(a, str) and a.startswith("/") and "trialkeeper-" in a for a in bound), bound
            agent.kill()
            await agent.wait()
        assert not (Path("/tmp") / name[1:]).exists() and not list(Path("/tmp").glob(name[1:] + "*"))

    run_async(body)


# A background job that leaves the trial's process group and ends on its own while the
# trial runs: the agent, its parent now, must reap it. The trial succeeds once it was.
SHORT_LIVED_ORPHAN = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork():
        os._exit(0)
    open("orphan.pid.tmp", "w").write(str(os.getpid()))
    os.rename("orphan.pid.tmp", "orphan.pid")
    os._exit(0)
os.wait()
deadline = time.monotonic() + 20
while not os.path.exists("orphan.pid"):
    if time.monotonic() > deadline:
        sys.exit("the orphan never wrote its pid")
    time.sleep(0.01)
pid = int(open("orphan.pid").read())
deadline = time.monotonic() + 20
while os.path.exists(f"/proc/{pid}"):
    if time.monotonic() > deadline:
        sys.exit(f"orphan {pid} was never reaped: " + open(f"/proc/{pid}/stat").read())
    time.sleep(0.05)
"""


def test_orphans_that_end_while_their_trial_runs_are_reaped(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", SHORT_LIVED_ORPHAN)
    config = build_config(tmp_path, trialConcurrency=1)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            info = await (await c.submit({})).wait(WAIT_S)
            assert info.status is TrialStatus.SUCCEEDED, (info.status, info.reason, info.stderr_tail)

    run_async(body)
