"""What the CLI shows of paused trials and checkpoints, read from a real store; what `run`
says a stop did; the limits `resume --max-trials` and `--max-duration` give."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from trialkeeper.coordinator import cli
from trialkeeper.coordinator.cli.ended import extended_config, stop_note
from trialkeeper.coordinator.cli.views import size_text
from trialkeeper.coordinator.config.experiment import parse_config
from trialkeeper.coordinator.engine import checkpoints as ck
from trialkeeper.coordinator.engine.model import TrialInfo
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.store.store import Store


def _checkpoint(trial_id: str, step: int, size: int, location: str = "") -> ck.Checkpoint:
    return ck.Checkpoint(
        trial_id, step, metric_index=step, size_bytes=size, digest="sha256:00", files=(ck.CheckpointFile("m", size),),
        location=location, saved_at=1_800_000_000.0 + step, env_id="env-1",
    )


@pytest.fixture
def exp(tmp_path: Path) -> Path:
    store = Store.in_dir(tmp_path / "exp")
    store.create_experiment("exp1", "demo", {"trialCommand": "python trial.py"})
    for seq, (tid, status) in enumerate([("run1", "RUNNING"), ("pau1", "PAUSED"), ("pau2", "PAUSED")]):
        store.insert_trial({
            "id": tid, "seq": seq, "status": status, "parameters_json": json.dumps({"x": seq}),
            "command": "python trial.py", "gpu_number": 0, "submitted_at": 1000.0 + seq,
        })
    store.keep(ck.CheckpointRecorded(_checkpoint("pau1", 3, 512)))
    store.keep(ck.CheckpointRecorded(_checkpoint("pau1", 7, 3 * 2**20)))
    store.keep(ck.CheckpointRecorded(_checkpoint("pau1", 9, 2**30, "s3://bucket/ck/exp1/pau1/9")))
    store.keep(ck.CheckpointRemoved("pau1", 3, 1_800_000_100.0))  # retention removed its files
    store.close()
    return tmp_path / "exp"


def test_trials_of_one_status_include_paused(exp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["trials", str(exp), "--status", "paused", "--json"]) == 0
    assert [t["id"] for t in json.loads(capsys.readouterr().out)] == ["pau1", "pau2"]
    assert cli.main(["trials", str(exp), "--status", "BROKEN"]) == 2
    err = capsys.readouterr().err
    assert "--status: 'BROKEN' is not one of WAITING, RUNNING, " in err and ", PAUSED" in err


def test_a_trial_shows_its_kept_checkpoints(exp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["trial", str(exp), "pau1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "trial pau1 (#1): PAUSED"
    at = out.index("checkpoints (2, newest last):")
    assert out[at + 1].startswith("  step 7: 3.0 MiB, saved ")
    assert out[at + 1].endswith(f", in {exp / 'checkpoints' / 'pau1' / '7'}")
    assert out[at + 2].startswith("  step 9: 1.0 GiB, saved ") and out[at + 2].endswith(", in s3://bucket/ck/exp1/pau1/9")

    assert cli.main(["trial", str(exp), "pau1", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["status"] == "PAUSED" and shown["checkpoint_step"] == 9
    assert [(c["step"], c["size_bytes"], c["metric_index"]) for c in shown["checkpoints"]] == [
        (7, 3 * 2**20, 7), (9, 2**30, 9)
    ]
    assert shown["checkpoints"][0]["where"] == str(exp / "checkpoints" / "pau1" / "7")

    assert cli.main(["trial", str(exp), "pau2"]) == 0
    assert "checkpoints: none" in capsys.readouterr().out.splitlines()


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (5 * 2**40, "5.0 TiB")])
def test_sizes_read_as_people_read_them(n: int, text: str) -> None:
    assert size_text(n) == text


def _trial(tid: str, status: TrialStatus, reason: str = "", started: bool = True) -> TrialInfo:
    return TrialInfo(
        tid, 0, status, {}, None, (), None, None, None, None, reason, "", 1.0, 2.0 if started else None, None, 1,
    )


def test_what_run_says_a_stop_did() -> None:
    exp = Path("/exp")
    canceled = _trial("c1", TrialStatus.SYS_CANCELED, "the experiment stopped")
    no_checkpoint = _trial(
        "c2", TrialStatus.SYS_CANCELED,
        "saved no checkpoint within 2 s of being asked to pause; it has no checkpoint to continue from",
    )
    paused = [_trial("p1", TrialStatus.PAUSED), _trial("p2", TrialStatus.PAUSED, started=False)]
    done = _trial("d1", TrialStatus.SUCCEEDED)
    assert stop_note([done], exp) == "`trialkeeper resume /exp` goes on with the trials not started yet"
    assert stop_note([done, canceled, no_checkpoint], exp) == (
        "2 running trials canceled as SYS_CANCELED; `trialkeeper resume /exp` does not run them again: it goes on "
        "with the trials not submitted yet"
    )
    assert stop_note([*paused, done], exp) == (
        "2 trials paused; `trialkeeper resume /exp` continues them first, then goes on with the trials not "
        "submitted yet"
    )
    assert stop_note([paused[0], canceled], exp) == (
        "1 trial paused, 1 running trial canceled as SYS_CANCELED; `trialkeeper resume /exp` continues the paused "
        "one first and does not run the canceled one again"
    )


def test_resume_limits_replace_the_configs(tmp_path: Path) -> None:
    config = parse_config({
        "trialCommand": "x", "trialConcurrency": 1, "trainingService": {"platform": "local"}, "searchSpace": {},
        "tuner": {"name": "random"}, "maxTrialNumber": 4,
    }, tmp_path)
    same, given = extended_config(config, argparse.Namespace(max_trials=None, max_duration=None))
    assert same is config and not given
    more, given = extended_config(config, argparse.Namespace(max_trials=9, max_duration=60.0))
    assert given and more.max_trial_number == 9 and more.max_experiment_duration == 60.0
    assert more.trial_command == config.trial_command
    assert extended_config(config, argparse.Namespace())[1] is False  # `run` has neither option
