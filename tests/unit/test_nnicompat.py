"""NNI's legacy trial protocol on the agent's side: parameter.cfg and NNISDK_MEb lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trialkeeper.agent import nnicompat
from trialkeeper.agent.nnicompat import MAX_LINE_BYTES, NniLine, NniStdoutScanner, parse_line


def _metric(kind: str, value: object, sequence: int = 0) -> bytes:
    # What nni's LocalLegacyTrialCommandChannel prints, byte for byte in form.
    message = {"parameter_id": 3, "trial_job_id": "abc", "type": kind, "sequence": sequence, "value": json.dumps(value)}
    return b"NNISDK_MEb'" + json.dumps(message).encode() + b"'\n"


def test_parameter_cfg_is_what_nni_reads_and_leaves_no_temporary(tmp_path: Path) -> None:
    nnicompat.write_parameter_cfg(tmp_path, 7, '{"lr": 0.1, "name": "a\\u00e9"}')
    record = json.loads((tmp_path / "parameter.cfg").read_text())
    assert record == {
        "parameter_id": 7,
        "parameter_source": "algorithm",
        "parameters": {"lr": 0.1, "name": "aé"},
        "parameter_index": 0,
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["parameter.cfg"]


def test_environment_selects_the_legacy_channel_without_multi_phase(tmp_path: Path) -> None:
    env = nnicompat.nni_environment(
        trial_id="t1", sequence_id=4, experiment_id="e1", sys_dir=tmp_path, output_dir=tmp_path / "o"
    )
    assert env["NNI_PLATFORM"] == "local" and env["REUSE_MODE"] == "true"
    assert (env["NNI_TRIAL_JOB_ID"], env["NNI_EXP_ID"], env["NNI_TRIAL_SEQ_ID"]) == ("t1", "e1", "4")
    assert env["NNI_SYS_DIR"] == str(tmp_path) and env["NNI_OUTPUT_DIR"] == str(tmp_path / "o")
    assert "MULTI_PHASE" not in env and "NNI_TRIAL_COMMAND_CHANNEL" not in env


@pytest.mark.parametrize(
    "line,expected",
    [
        (_metric("PERIODICAL", 0.5), NniLine("intermediate", 0.5)),
        (_metric("FINAL", {"default": 0.9, "loss": 0.1}), NniLine("final", {"default": 0.9, "loss": 0.1})),
        (b"[2026-01-01 10:00:00] INFO " + _metric("FINAL", 3), NniLine("final", 3)),  # a logging prefix
        (_metric("PERIODICAL", 1).rstrip(b"\n") + b"\r\n", NniLine("intermediate", 1)),
        (b"NNISDK_MEb'" + json.dumps({"type": "REQUEST_PARAMETER", "sequence": 0}).encode() + b"'", NniLine()),
    ],
)
def test_lines_nni_prints(line: bytes, expected: NniLine) -> None:
    assert parse_line(line) == expected


@pytest.mark.parametrize(
    "line,words",
    [
        (b"NNISDK_MEb'{\"type\": \"FINAL\"", "closing quote"),
        (b"NNISDK_MEb'not json'", "not JSON"),
        (b"NNISDK_MEb'[1, 2]'", "not a JSON object"),
        (b"NNISDK_MEb'" + json.dumps({"type": "BOGUS", "value": "1"}).encode() + b"'", "unknown type 'BOGUS'"),
        (b"NNISDK_MEb'" + json.dumps({"type": "FINAL", "value": 1}).encode() + b"'", "not a JSON string"),
        (b"NNISDK_MEb'" + json.dumps({"type": "FINAL", "value": "{oops"}).encode() + b"'", "value is not JSON"),
        (b"NNISDK_MEb'\xff\xfe'", "not JSON"),
    ],
)
def test_malformed_lines_say_what_is_wrong(line: bytes, words: str) -> None:
    result = parse_line(line)
    assert not result.kind and words in result.problem, result


def test_scanner_reads_only_new_complete_lines(tmp_path: Path) -> None:
    log = tmp_path / "stdout.log"
    scanner = NniStdoutScanner(log)
    assert scanner.scan() == []  # no file yet
    whole = _metric("PERIODICAL", 1)
    with open(log, "ab") as f:
        f.write(b"epoch 1\n" + whole + whole[:20])
    assert scanner.scan() == [NniLine("intermediate", 1)]
    assert scanner.scan() == []  # the half line waits for its end
    with open(log, "ab") as f:
        f.write(whole[20:] + b"plain output\n" + _metric("FINAL", 2).rstrip(b"\n"))
    assert scanner.scan() == [NniLine("intermediate", 1)]
    # The trial ended: its last line counts even without a newline.
    assert scanner.scan(final=True) == [NniLine("final", 2)]
    assert scanner.scan(final=True) == []


def test_scanner_reports_an_oversized_line_once_and_goes_on(tmp_path: Path) -> None:
    log = tmp_path / "stdout.log"
    scanner = NniStdoutScanner(log)
    with open(log, "ab") as f:
        f.write(b"NNISDK_MEb'" + b"x" * (MAX_LINE_BYTES + 10))
    found = scanner.scan()
    assert [bool(x.problem) for x in found] == [True] and "longer than" in found[0].problem
    with open(log, "ab") as f:
        f.write(b"y" * 1000 + b"'\n" + _metric("FINAL", 5))
    assert scanner.scan(final=True) == [NniLine("final", 5)]


def test_scanner_reads_a_large_log_in_chunks(tmp_path: Path) -> None:
    log = tmp_path / "stdout.log"
    filler = b"z" * 1000 + b"\n"
    log.write_bytes(filler * 5000 + _metric("PERIODICAL", 1) + filler * 5000 + _metric("FINAL", 2))
    scanner = NniStdoutScanner(log)
    assert scanner.scan(final=True) == [NniLine("intermediate", 1), NniLine("final", 2)]
    assert scanner.offset == log.stat().st_size


def test_result_lines_are_left_out_of_the_output_shown() -> None:
    result = b"NNISDK_MEb'{\"type\": \"FINAL\"}'"
    data = b"one\n" + result + b"\ntwo\r\n" + result[:15]
    # While more may come, an unfinished result line is held back; other output is not.
    assert nnicompat.without_results(data, final=False) == (b"one\ntwo\r\n", result[:15])
    assert nnicompat.without_results(data, final=True) == (b"one\ntwo\r\n", b"")
    assert nnicompat.without_results(b"one\n50%", final=False) == (b"one\n50%", b"")
    assert nnicompat.without_results(b"a\n" + result, final=True) == (b"a\n", b"")


def test_a_pbt_trials_two_paths_are_its_own_checkpoint_directory() -> None:
    nni = {"x": 0.5, "load_checkpoint_dir": "/exp/nni/3/1", "save_checkpoint_dir": "/exp/nni/1/2"}
    live = "/agent/cache/t1/live-0-ab"
    dirs = nnicompat.pbt_dirs(json.dumps(nni), live)
    assert dirs is not None and dirs.step == 2
    assert json.loads(dirs.parameters_json) == {
        "x": 0.5, "load_checkpoint_dir": live, "save_checkpoint_dir": live,
    }
    # Under a user's all_checkpoint_dir whose last part is no number: step 0.
    odd = nni | {"save_checkpoint_dir": "/shared/ckpt/1/last/"}
    assert nnicompat.pbt_dirs(json.dumps(odd), "/live").step == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("rank", [1, 3])
def test_the_other_ranks_of_a_multi_node_pbt_trial_get_their_own_directory_never_saved(rank: int) -> None:
    # NNI's names with no all_checkpoint_dir are relative: as they are, a rank would write
    # them under its working directory (the shared code directory on Slurm).
    nni = {"x": 0.5, "load_checkpoint_dir": "nni-checkpoints/0/1", "save_checkpoint_dir": "nni-checkpoints/1/2"}
    live = f"/agent{rank}/cache/t1/live-0-cd"  # this rank's copy of the checkpoint the trial starts from
    dirs = nnicompat.pbt_dirs(json.dumps(nni), live, rank)
    assert dirs is not None and dirs.step is None  # what it leaves there is not saved
    assert json.loads(dirs.parameters_json) == {"x": 0.5, "load_checkpoint_dir": live, "save_checkpoint_dir": live}
    assert nnicompat.pbt_dirs(json.dumps(nni), live, 0).step == 2  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "parameters",
    [
        '{"x": 0.5}',
        '{"x": 0.5, "save_checkpoint_dir": "/a/0"}',  # both paths or none
        '{"load_checkpoint_dir": 3, "save_checkpoint_dir": "/a/0"}',
        '["save_checkpoint_dir"]',
        '{"save_checkpoint_dir": ',
    ],
)
def test_other_trials_keep_their_parameters(parameters: str) -> None:
    assert nnicompat.pbt_dirs(parameters, "/live") is None
    assert nnicompat.pbt_dirs('{"load_checkpoint_dir": "/a/0", "save_checkpoint_dir": "/a/0"}', "") is None
