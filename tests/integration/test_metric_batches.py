"""Results reported in a tight loop share datagrams and messages: every one of them is stored
once, in order, however the trial ends, and a bad one in a batch is refused alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import build_config, run_async, write_script
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import TrialStatus

WAIT_S = 60.0

# Bursts far faster than the SDK's linger, so that they share datagrams, then an ending
# chosen by the parameter `end`.
BURSTS = """
import os, sys
from trialkeeper.agent import trial

end = trial.get_next_parameter()["end"]
n = 0
for burst in range(3):
    for _ in range(2000):
        trial.report_intermediate_result(n * 0.5 if n % 7 else {"default": float(n), "loss": 1.0 / (n + 1)})
        n += 1
if end == "fork":
    # A child reports its own burst and leaves by sys.exit; the parent waits for it, then
    # reports more: the child's results are its own, sent once, none of the parent's again.
    pid = os.fork()
    if pid == 0:
        for i in range(500):
            trial.report_intermediate_result(100000.0 + i)
        sys.exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    for i in range(10):
        trial.report_intermediate_result(200000.0 + i)
        n += 1
if end == "final":
    trial.report_final_result(42.0)
elif end == "sys.exit":
    sys.exit(0)
elif end == "exception":
    raise RuntimeError("the trial fails after its last results")
"""


def _expected_values(n: int) -> list[float]:
    return [float(i) if i % 7 == 0 else i * 0.5 for i in range(n)]


@pytest.mark.slow
def test_every_result_of_a_tight_loop_is_stored_once_in_order_however_the_trial_ends(tmp_path: Path) -> None:
    write_script(tmp_path, "bursts.py", BURSTS)
    config = build_config(tmp_path, trialConcurrency=2, maxTrialNumber=10)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            assert c.store is not None
            ends = ["final", "sys.exit", "normal", "exception", "fork"]
            handles = [await c.submit({"end": end}, command="python bursts.py") for end in ends]
            for end, handle in zip(ends, handles):
                info = await handle.wait(WAIT_S)
                expected_status = TrialStatus.FAILED if end == "exception" else TrialStatus.SUCCEEDED
                assert info.status is expected_status, (end, info.status, info.reason, info.stderr_tail)
                rows = c.store.metrics(info.id)
                values = [r.value for r in rows]
                intermediate = [r for r in rows if r.kind == "intermediate"]
                assert [r.index for r in rows] == list(range(len(rows))), end
                if end == "fork":
                    # The child's 500 come between the parent's 6,000 and its last 10.
                    assert values == _expected_values(6000) + [100000.0 + i for i in range(500)] + [
                        200000.0 + i for i in range(10)
                    ]
                else:
                    assert [r.value for r in intermediate] == _expected_values(6000), end
                assert intermediate[7].value_json == '{"default":7.0,"loss":0.125}'
                assert intermediate[3].value_json == "1.5"
                if end == "final":
                    assert rows[-1].kind == "final" and rows[-1].value == 42.0 and info.final_metric == 42.0
                else:
                    assert all(r.kind == "intermediate" for r in rows), end

    run_async(body, timeout=180.0)


# Batches as a trial might write them by hand, past the SDK's checks.
HOSTILE_BATCHES = """
import json, os, socket
from trialkeeper.agent import trial

me = os.environ["TRIALKEEPER_TRIAL_ID"]
path = os.environ["TRIALKEEPER_SOCKET"]
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

def raw(text):
    sock.sendto(text.encode(), path)

raw('{"trial": "%s", "kind": "intermediate", "values": [1.0, NaN, 2.0, "three", 3.0, Infinity, '
    '{"default": 4.0}, {"nodefault": 1}, 5, true, %s, 6.0]}' % (me, "9" * 400))
raw('{"trial": "%s", "kind": "intermediate", "values": 7.0}' % me)
raw('{"trial": "%s", "kind": "intermediate", "values": [[8.0], 9.0]}' % me)
raw('{"trial": "%s", "kind": "sideways", "values": [10.0, 11.0]}' % me)
raw('{"trial": "%s", "kind": "final", "values": [12.0, 13.0]}' % me)
raw('{"trial": "%s", "kind": "intermediate", "values": []}' % me)
raw('{"trial": "%s", "kind": "intermediate", "values": [1e308, 1e308, -1e308]}' % me)
raw('{"trial": "someone-else", "kind": "intermediate", "values": [99.0, 98.0]}')
trial.report_intermediate_result(14.0)
"""


def test_a_bad_result_in_a_batched_datagram_is_refused_alone_with_a_note(tmp_path: Path) -> None:
    write_script(tmp_path, "hostile.py", HOSTILE_BATCHES)
    config = build_config(tmp_path, trialConcurrency=1)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            assert c.store is not None
            info = await (await c.submit({}, command="python hostile.py")).wait(WAIT_S)
            assert info.status is TrialStatus.SUCCEEDED, (info.status, info.reason, info.stderr_tail)
            rows = c.store.metrics(info.id)
            assert [r.index for r in rows] == list(range(len(rows)))
            assert [(r.kind, r.value, r.value_json) for r in rows] == [
                ("intermediate", 1.0, "1.0"),
                ("intermediate", 2.0, "2.0"),
                ("intermediate", 3.0, "3.0"),
                ("intermediate", 4.0, '{"default":4.0}'),
                ("intermediate", 5.0, "5"),
                ("intermediate", 6.0, "6.0"),
                ("intermediate", 9.0, "9.0"),
                ("final", 12.0, "12.0"),
                ("intermediate", 1e308, "1e+308"),
                ("intermediate", 1e308, "1e+308"),
                ("intermediate", -1e308, "-1e+308"),
                ("intermediate", 14.0, "14.0"),
            ]
            assert info.final_metric == 12.0
            err = (c.experiment_dir / "trials" / info.id / "stderr.log").read_text()
            notes = [ln for ln in err.splitlines() if ln.startswith("[trialkeeper]")]
            # NaN, "three", Infinity, no default, true, beyond a float; values not a list;
            # [8.0]; two of an unknown kind; a second final.
            assert len(notes) == 11, notes
            assert any("'values' must be a list" in n for n in notes), notes
            assert any("finite" in n and "nan" in n for n in notes), notes
            assert any("too large for a float" in n for n in notes), notes
            assert sum("unknown result kind 'sideways'" in n for n in notes) == 2, notes
            assert any("already reported" in n for n in notes), notes

    run_async(body)
