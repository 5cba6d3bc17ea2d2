"""Checkpoints in the decision core, in virtual time: recorded or refused, kept or removed, a
lost trial continued from its last one, pause and continue, a stop that pauses, a restore."""

from __future__ import annotations

from typing import Any

from test_engine import Sim, ready_sim, running
from trialkeeper.coordinator.engine import checkpoints as ck
from trialkeeper.coordinator.engine import events as ev
from trialkeeper.coordinator.engine.states import TrialStatus

FILES = (ck.CheckpointFile("model.pt", 7), ck.CheckpointFile("opt/state.bin", 3))


def saved(trial_id: str, step: int, *, metric_index: int = 0, size: int = 10, files: Any = FILES,
          problem: str = "") -> ck.CheckpointSavedReported:
    return ck.CheckpointSavedReported(trial_id, step, metric_index, size, f"sha256:{step}", files, "", 0.0, problem)


def sent(sim: Sim, kind: type) -> list[Any]:
    return [s.message for s in sim.take(ev.Send) if isinstance(s.message, kind)]


def test_a_saved_checkpoint_is_recorded_before_its_ack_and_the_older_one_removed() -> None:
    sim = ready_sim()
    env = running(sim)
    sim.report(env, saved("t1", 1, metric_index=2))
    sim.out.clear()
    sim.report(env, saved("t1", 2, metric_index=4))
    kinds = [type(i).__name__ for i in sim.out]
    assert kinds.index("CheckpointRecorded") < kinds.index("Ack")
    removed = sim.take(ck.RemoveCheckpoint)
    assert [(r.checkpoint.trial_id, r.checkpoint.step) for r in removed] == [("t1", 1)]
    assert [f.step for f in sim.take(ck.CheckpointRemoved)] == [1]
    t = sim.engine.trials["t1"]
    assert [c.step for c in t.checkpoints] == [2] and t.info().checkpoint_step == 2


def test_checkpoints_per_trial_keeps_the_newest_ones() -> None:
    sim = ready_sim(checkpoints_per_trial=2)
    env = running(sim)
    for step in (1, 2, 3):
        sim.report(env, saved("t1", step))
    assert [r.checkpoint.step for r in sim.take(ck.RemoveCheckpoint)] == [1]
    assert [c.step for c in sim.engine.trials["t1"].checkpoints] == [2, 3]


def test_a_checkpoint_over_the_limit_is_refused_before_the_ack_naming_the_limit() -> None:
    sim = ready_sim(max_checkpoint_bytes=5)
    env = running(sim)
    sim.out.clear()
    sim.report(env, saved("t1", 1))
    kinds = [type(i).__name__ for i in sim.out]
    assert "CheckpointRecorded" not in kinds
    refused = sent(sim, ck.CheckpointRefused)
    assert len(refused) == 1 and "maxCheckpointSize" in refused[0].reason and "10 bytes" in refused[0].reason
    assert kinds.index("Send") < kinds.index("Ack")
    # Its files, made whole in the experiment's directory before the core heard of it, go.
    assert [r.checkpoint.step for r in sim.take(ck.RemoveCheckpoint)] == [1]
    assert sim.engine.trials["t1"].checkpoints == []


def test_an_unsafe_chunk_refuses_its_whole_save_and_is_never_written() -> None:
    sim = ready_sim()
    env = running(sim)
    sim.report(env, ck.CheckpointChunkReported("t1", 1, "../../etc/passwd", 0, b"x"))
    sim.report(env, ck.CheckpointChunkReported("t1", 1, "model.pt", 0, b"1234567"))
    writes = sim.take(ck.WriteCheckpointChunk)
    assert [w.path for w in writes] == ["model.pt"]
    sim.report(env, saved("t1", 1))
    assert "a part of it was refused" in sent(sim, ck.CheckpointRefused)[0].reason


def test_a_shell_problem_with_the_files_refuses_the_save() -> None:
    sim = ready_sim()
    env = running(sim)
    sim.report(env, saved("t1", 1, problem="the coordinator did not get all of it: model.pt is missing"))
    assert "model.pt is missing" in sent(sim, ck.CheckpointRefused)[0].reason
    assert sim.engine.trials["t1"].checkpoints == []


def test_a_save_from_an_environment_the_trial_is_not_on_is_refused() -> None:
    sim = ready_sim()
    env = running(sim)
    other = next(e for e in sim.engine.envs if e != env)
    sim.report(other, saved("t1", 1))
    assert "not placed on this environment" in sent(sim, ck.CheckpointRefused)[0].reason


def test_a_lost_trial_continues_from_its_checkpoint_and_its_later_results_are_superseded() -> None:
    sim = ready_sim(max_trial_retries=1)
    env = running(sim)
    sim.report(env, saved("t1", 5, metric_index=3))
    sim.starts()
    sim.end(env, "t1", ev.Outcome.LOST)
    t = sim.engine.trials["t1"]
    assert t.status is TrialStatus.WAITING and "from step 5" in t.waiting_reason
    assert "not counted" in t.waiting_reason and t.retries == 0  # it saved since it started
    sim.advance(5)
    sim.feed(ev.Ticked())
    start = sim.starts()["t1"]
    assert start.checkpoint is not None and start.checkpoint.step == 5
    assert start.first_metric_index == 3 and not start.resumes_metrics
    assert [(s.trial_id, s.from_index) for s in sim.take(ck.MetricsSuperseded)] == [("t1", 3)]


def test_losses_without_progress_use_up_retries_and_then_fail() -> None:
    sim = ready_sim(max_trial_retries=1)
    env = running(sim)
    sim.report(env, saved("t1", 1))
    sim.end(env, "t1", ev.Outcome.LOST)  # free: it saved since the last loss
    sim.advance(5)
    sim.feed(ev.Ticked())
    env = sim.engine.trials["t1"].env_id
    assert env is not None
    sim.run(env, "t1")
    sim.end(env, "t1", ev.Outcome.LOST)  # counted: 1 of 1
    t = sim.engine.trials["t1"]
    assert t.status is TrialStatus.WAITING and t.retries == 1
    sim.advance(5)
    sim.feed(ev.Ticked())
    env = sim.engine.trials["t1"].env_id
    assert env is not None
    sim.run(env, "t1")
    sim.end(env, "t1", ev.Outcome.LOST)
    assert t.status is TrialStatus.FAILED and "environment lost" in t.reason


def test_progress_resets_retries_can_be_turned_off() -> None:
    sim = ready_sim(max_trial_retries=0, progress_resets_retries=False)
    env = running(sim)
    sim.report(env, saved("t1", 1))
    sim.end(env, "t1", ev.Outcome.LOST)
    assert sim.status("t1") is TrialStatus.FAILED


def test_pause_asks_the_agent_and_a_paused_end_frees_the_slot_then_continue_restarts_it() -> None:
    sim = ready_sim(pause_grace_s=30.0)
    env = running(sim)
    sim.report(env, saved("t1", 2, metric_index=2))
    sim.feed(ck.PauseRequested("t1", "paused by the user"))
    pauses = sent(sim, ck.PauseTrial)
    assert [(p.trial_id, p.grace_s) for p in pauses] == [("t1", 30.0)]
    sim.report(env, saved("t1", 3, metric_index=3))
    sim.report(env, ev.TrialEndReported("t1", ev.Outcome.PAUSED, 0, None, "", "", 0.0))
    t = sim.engine.trials["t1"]
    assert t.status is TrialStatus.PAUSED and t.env_id is None and "continues from step 3" in t.reason
    assert sim.engine.fleet.envs[env].holders == set()
    sim.starts()
    sim.feed(ck.ContinueRequested("t1", {"x": 2}))
    assert [f.parameters for f in sim.take(ck.TrialParametersChanged)] == [{"x": 2}]
    sim.feed(ev.Ticked())
    start = sim.starts()["t1"]
    assert start.parameters == {"x": 2} and start.checkpoint is not None and start.checkpoint.step == 3
    assert t.retries == 0


def test_a_trial_that_never_checkpoints_is_canceled_when_asked_to_pause() -> None:
    sim = ready_sim()
    env = running(sim)
    sim.feed(ck.PauseRequested("t1", "paused by the user"))
    sim.report(env, ev.TrialEndReported("t1", ev.Outcome.PAUSED, None, 9, "saved no checkpoint within 5 s", "", 0.0))
    t = sim.engine.trials["t1"]
    assert t.status is TrialStatus.USER_CANCELED and "no checkpoint to continue from" in t.reason


def test_a_trial_lost_while_pausing_is_paused_at_its_checkpoint_and_one_canceled_ends_canceled() -> None:
    """An agent stopped by a second signal ends its trials lost, those being paused or
    canceled too: each ends as the coordinator asked, never as a failure of the trial."""
    sim = ready_sim(pause_grace_s=30.0, environment_count=2, trial_concurrency=2)
    env = running(sim)
    sim.report(env, saved("t1", 2))
    other = running(sim, "t2")
    sim.feed(ck.PauseRequested("t1", "paused by the user"))
    sim.feed(ev.CancelRequested("t2", "canceled by the user", TrialStatus.USER_CANCELED))
    sim.report(env, ev.TrialEndReported("t1", ev.Outcome.LOST, None, 15, "its agent was stopped", "", 0.0))
    sim.report(other, ev.TrialEndReported("t2", ev.Outcome.LOST, None, 15, "its agent was stopped", "", 0.0))
    t1 = sim.engine.trials["t1"]
    assert t1.status is TrialStatus.PAUSED and "continues from step 2" in t1.reason, t1.reason
    assert sim.status("t2") is TrialStatus.USER_CANCELED


def test_a_waiting_trial_is_paused_at_once_and_continues_ahead_of_the_others() -> None:
    sim = ready_sim(environment_count=1, trial_concurrency=1)
    running(sim, "t1")
    sim.submit("t2")
    sim.submit("t3")
    sim.feed(ck.PauseRequested("t3", "held back"))
    assert sim.status("t3") is TrialStatus.PAUSED and "t3" not in sim.engine.queue
    sim.feed(ck.ContinueRequested("t3"))
    assert next(iter(sim.engine.queue)) == "t3"


def test_a_stop_that_pauses_pauses_running_trials_and_drains_the_agents() -> None:
    sim = ready_sim(pause_grace_s=20.0, environment_count=2, trial_concurrency=2)
    env = running(sim)
    sim.report(env, saved("t1", 1))
    running(sim, "t0")  # it never saved a checkpoint: canceled, as a stop always did
    sim.submit("t2")
    sim.out.clear()
    sim.feed(ev.StopRequested(25.0, pause=True))
    messages = [s.message for s in sim.take(ev.Send)]
    assert [m.trial_id for m in messages if isinstance(m, ck.PauseTrial)] == ["t1"]
    assert [m.trial_id for m in messages if isinstance(m, ev.CancelTrial)] == ["t0"]
    shutdowns = [m for m in messages if isinstance(m, ev.Shutdown)]
    assert shutdowns and all(m.drain for m in shutdowns)
    assert sim.status("t2") is TrialStatus.PAUSED  # it waited: held back at once
    sim.feed(ev.StopCompleted())  # the agent never confirmed: t1 has a checkpoint to continue from
    assert sim.status("t1") is TrialStatus.PAUSED


def test_a_fork_starts_from_another_trials_checkpoint_which_is_then_not_removed() -> None:
    sim = ready_sim(environment_count=1, trial_concurrency=1)
    env = running(sim)
    sim.report(env, saved("t1", 1, metric_index=1))
    sim.feed(ev.TrialSubmitted("t2", {"x": 3}, "python trial.py", 0, 0, checkpoint_from="t1"))
    added = sim.take(ev.TrialAdded)
    assert added[-1].forked_from == ("t1", 1)
    sim.report(env, saved("t1", 2))
    assert sim.take(ck.RemoveCheckpoint) == []  # t2 still starts from it
    sim.end(env, "t1", ev.Outcome.SUCCEEDED)
    sim.feed(ev.Ticked())
    start = sim.starts()["t2"]
    assert start.checkpoint is not None and (start.checkpoint.trial_id, start.checkpoint.step) == ("t1", 1)


def test_a_fetch_is_answered_with_the_checkpoint_only_for_the_trial_it_continues() -> None:
    sim = ready_sim(max_trial_retries=1)
    env = running(sim)
    sim.report(env, saved("t1", 4))
    sim.end(env, "t1", ev.Outcome.LOST)
    sim.advance(5)
    sim.feed(ev.Ticked())
    env = sim.engine.trials["t1"].env_id
    assert env is not None
    link = sim.links[env]
    sim.feed(ck.CheckpointFetchRequested(env, link, "t1", 4, "opt/state.bin", 1))
    sends = sim.take(ck.SendCheckpoint)
    assert [(s.link, s.checkpoint.step, s.path, s.offset) for s in sends] == [(link, 4, "opt/state.bin", 1)]
    sim.feed(ck.CheckpointFetchRequested(env, link, "t1", 3, "", 0))
    assert "at step 3" in sent(sim, ck.CheckpointRefused)[0].reason


def test_restore_brings_back_paused_trials_and_their_checkpoints() -> None:
    rows = [{
        "id": "t1", "seq": 0, "status": "PAUSED", "parameters_json": "{}", "command": "c", "gpu_number": 0,
        "submitted_at": 1.0, "environment_id": None, "gpu_indices_json": "[]", "gpu_uuids_json": "[]",
        "exit_code": None, "signal": None, "reason": "", "stderr_tail": "", "final_metric": None,
        "final_metric_json": None, "attempts": 2, "started_at": None, "ended_at": None, "platforms_json": "[]",
        "retries": 0, "progressed": 1, "forked_from_json": None,
    }]
    checkpoints = [
        {"trial_id": "t1", "step": s, "metric_index": s, "size_bytes": 7, "digest": "d", "location": "",
         "files_json": '[["model.pt", 7, 420]]', "saved_at": float(s), "env_id": "e", "removed_at": gone}
        for s, gone in ((1, 5.0), (2, None))
    ]
    sim = Sim()
    sim.engine.restore(rows, [], {}, checkpoints, now=1.0, wall=1.0)
    t = sim.engine.trials["t1"]
    assert t.status is TrialStatus.PAUSED and [c.step for c in t.checkpoints] == [2]
    assert t.checkpoints[0].files == (ck.CheckpointFile("model.pt", 7, 420),)
    assert "t1" not in sim.engine.queue  # a paused trial waits to be continued, not placed


def test_a_finished_experiment_keeps_the_checkpoints_of_succeeded_trials_only() -> None:
    sim = ready_sim()
    env1 = running(sim, "t1")
    env2 = running(sim, "t2")
    sim.report(env1, saved("t1", 1))
    sim.report(env2, saved("t2", 1))
    sim.end(env1, "t1", ev.Outcome.SUCCEEDED)
    sim.end(env2, "t2", ev.Outcome.FAILED)
    sim.take(ck.RemoveCheckpoint)
    sim.feed(ev.StopRequested(5.0))
    sim.feed(ev.StopCompleted())
    assert [r.checkpoint.trial_id for r in sim.take(ck.RemoveCheckpoint)] == ["t2"]


def test_a_stop_to_be_resumed_keeps_every_checkpoint() -> None:
    sim = ready_sim(checkpoints_after_end="none")
    env = running(sim)
    sim.report(env, saved("t1", 1))
    sim.feed(ev.StopRequested(5.0, pause=True))
    sim.feed(ev.StopCompleted())
    assert sim.take(ck.RemoveCheckpoint) == [] and sim.status("t1") is TrialStatus.PAUSED


def test_an_agent_that_reconnects_is_told_again_of_the_saves_refused_since_its_last_recorded_one() -> None:
    sim = ready_sim(max_checkpoint_bytes=5)
    env = running(sim)
    sim.report(env, saved("t1", 1))  # 10 bytes: refused; the refusal may be lost with the stream
    sim.take(ev.Send)
    sim.feed(ev.AgentDisconnected(env, sim.links[env]))
    link = sim.register(env, instance=f"i-{env}-{sim.links[env]}", active=("t1",))
    welcome = next(s.message for s in sim.take(ev.Send) if s.link == link and isinstance(s.message, ev.Welcome))
    assert [(r.trial_id, r.step) for r in welcome.checkpoint_refusals] == [("t1", 1)]
    assert "maxCheckpointSize" in welcome.checkpoint_refusals[0].reason


def test_an_uploaded_checkpoints_digest_comes_later_and_reaches_every_trial_that_holds_it() -> None:
    sim = ready_sim(environment_count=1, trial_concurrency=1)
    env = running(sim)
    sim.report(env, ck.CheckpointSavedReported("t1", 2, 1, 10, "", FILES, "", 0.0))  # uploaded: no digest yet
    sim.feed(ev.TrialSubmitted("t2", {"x": 3}, "python trial.py", 0, 0, checkpoint_from="t1"))
    sim.out.clear()
    sim.feed(ck.CheckpointDigested("t1", 2, "sha256:abc"))
    assert [(f.trial_id, f.step, f.digest) for f in sim.take(ck.CheckpointDigestKnown)] == [("t1", 2, "sha256:abc")]
    t1, t2 = sim.engine.trials["t1"], sim.engine.trials["t2"]
    assert t1.checkpoints[0].digest == "sha256:abc" and t2.forked_from is not None
    assert t2.forked_from.digest == "sha256:abc"
    sim.feed(ck.CheckpointDigested("t1", 9, "sha256:zzz"))  # none such: nothing to record
    assert sim.take(ck.CheckpointDigestKnown) == []


def test_a_paused_trial_continues_from_another_trials_checkpoint_and_its_own_go() -> None:
    sim = ready_sim(environment_count=2, trial_concurrency=2)
    env1 = running(sim, "t1")
    env2 = running(sim, "t2")
    sim.report(env1, saved("t1", 4, metric_index=4))
    sim.report(env2, saved("t2", 3, metric_index=3))
    sim.feed(ck.PauseRequested("t2", "exploit"))
    sim.report(env2, ev.TrialEndReported("t2", ev.Outcome.PAUSED, 0, None, "", "", 0.0))
    sim.out.clear()
    sim.feed(ck.ContinueRequested("t2", {"lr": 0.2}, checkpoint_from="t1"))
    # Its own checkpoint goes, files too; it now continues from t1's, as a trial forked from it.
    assert [(r.checkpoint.trial_id, r.checkpoint.step) for r in sim.take(ck.RemoveCheckpoint)] == [("t2", 3)]
    assert [(f.trial_id, f.step) for f in sim.take(ck.CheckpointRemoved)] == [("t2", 3)]
    assert [(f.trial_id, f.forked_from) for f in sim.take(ck.TrialForked)] == [("t2", ("t1", 4))]
    sim.report(env1, saved("t1", 5, metric_index=5))
    assert sim.take(ck.RemoveCheckpoint) == []  # t2 still continues from t1's step 4
    sim.feed(ev.Ticked())
    start = sim.starts()["t2"]
    assert start.parameters == {"lr": 0.2} and start.checkpoint is not None
    assert (start.checkpoint.trial_id, start.checkpoint.step) == ("t1", 4) and start.first_metric_index == 4
    # Its results from t1's checkpoint's on are the continued run's.
    assert [(f.trial_id, f.from_index) for f in sim.take(ck.MetricsSuperseded)] == [("t2", 4)]
    env = sim.engine.trials["t2"].env_id
    assert env is not None
    link = sim.links[env]
    sim.feed(ck.CheckpointFetchRequested(env, link, "t2", 4, "", 0))  # its agent downloads t1's files
    assert [(s.checkpoint.trial_id, s.checkpoint.step) for s in sim.take(ck.SendCheckpoint)] == [("t1", 4)]
    sim.report(env, saved("t2", 5, metric_index=5))  # its own again: t1's step 4 is let go at t1's next save
    sim.report(env1, saved("t1", 6, metric_index=6))
    removed = {(r.checkpoint.trial_id, r.checkpoint.step) for r in sim.take(ck.RemoveCheckpoint)}
    assert removed == {("t1", 4), ("t1", 5)}


def test_a_checkpoint_another_trial_continues_from_keeps_its_files_when_its_trial_is_exploited() -> None:
    sim = ready_sim(environment_count=3, trial_concurrency=3)
    env1, env2 = running(sim, "t1"), running(sim, "t2")
    sim.report(env1, saved("t1", 4, metric_index=4))
    sim.report(env2, saved("t2", 2, metric_index=2))
    sim.feed(ev.TrialSubmitted("t3", {"x": 3}, "python trial.py", 0, 0, checkpoint_from="t2"))
    sim.feed(ck.PauseRequested("t2", "exploit"))
    sim.report(env2, ev.TrialEndReported("t2", ev.Outcome.PAUSED, 0, None, "", "", 0.0))
    sim.out.clear()
    sim.feed(ck.ContinueRequested("t2", None, checkpoint_from="t1"))
    assert [(f.trial_id, f.step) for f in sim.take(ck.CheckpointRemoved)] == [("t2", 2)]  # no longer t2's
    assert sim.take(ck.RemoveCheckpoint) == []  # but t3 starts from its files


def test_restore_gives_an_exploited_trial_the_checkpoint_it_continues_from() -> None:
    row = {
        "seq": 0, "status": "PAUSED", "parameters_json": "{}", "command": "c", "gpu_number": 0,
        "submitted_at": 1.0, "environment_id": None, "gpu_indices_json": "[]", "gpu_uuids_json": "[]",
        "exit_code": None, "signal": None, "reason": "", "stderr_tail": "", "final_metric": None,
        "final_metric_json": None, "attempts": 1, "started_at": None, "ended_at": None, "platforms_json": "[]",
        "retries": 0, "progressed": 1,
    }
    rows = [{**row, "id": "t1", "forked_from_json": None}, {**row, "id": "t2", "forked_from_json": '["t1", 4]'}]
    checkpoints = [
        {"trial_id": tid, "step": s, "metric_index": s, "size_bytes": 7, "digest": "d", "location": "",
         "files_json": '[["model.pt", 7, 420]]', "saved_at": float(s), "env_id": "e", "removed_at": gone}
        for tid, s, gone in (("t1", 4, None), ("t2", 3, 9.0))
    ]
    sim = Sim()
    sim.engine.restore(rows, [], {}, checkpoints, now=1.0, wall=1.0)
    t2 = sim.engine.trials["t2"]
    assert t2.checkpoints == [] and t2.checkpoint is not None and (t2.checkpoint.trial_id, t2.checkpoint.step) == (
        "t1", 4)


def test_an_exploited_trial_lost_before_its_own_save_continues_elsewhere_from_the_checkpoint_it_took() -> None:
    sim = ready_sim(environment_count=2, trial_concurrency=2, max_trial_retries=1)
    env1, env2 = running(sim, "t1"), running(sim, "t2")
    sim.report(env1, saved("t1", 6, metric_index=6))
    sim.report(env2, saved("t2", 4, metric_index=4))
    sim.feed(ck.PauseRequested("t2", "exploit"))
    sim.report(env2, ev.TrialEndReported("t2", ev.Outcome.PAUSED, 0, None, "", "", 0.0))
    assert sim.engine.trials["t2"].reason == "paused (exploit); continues from step 4"  # its own, as paused
    sim.feed(ck.ContinueRequested("t2", {"lr": 0.3}, checkpoint_from="t1"))
    # The continue says whose state it takes, not the step of the trial's own save.
    assert sim.engine.trials["t2"].status is TrialStatus.WAITING
    assert [c.reason for c in sim.take(ev.TrialStatusChanged) if c.trial_id == "t2"][-1] == (
        "continued from trial t1's checkpoint at step 6, with new parameters")
    sim.feed(ev.Ticked())
    env = sim.engine.trials["t2"].env_id
    assert env is not None
    sim.run(env, "t2")
    sim.out.clear()
    sim.end(env, "t2", ev.Outcome.LOST)
    sim.advance(5)
    sim.feed(ev.Ticked())
    start = sim.starts()["t2"]
    assert start.parameters == {"lr": 0.3} and start.checkpoint is not None
    assert (start.checkpoint.trial_id, start.checkpoint.step, start.first_metric_index) == ("t1", 6, 6)
    assert [(f.trial_id, f.from_index) for f in sim.take(ck.MetricsSuperseded)] == [("t2", 6)]
    assert sim.engine.trials["t2"].retries == 0  # it had saved a checkpoint since its last loss


def test_a_judged_save_is_acked_only_after_the_pause_the_search_decided_on_it() -> None:
    sim = ready_sim(pause_grace_s=30.0)
    sim.engine.publish_checkpoints, sim.engine.save_hold_s = True, 2.0
    env = running(sim)
    link = sim.links[env]
    sim.take(ev.Ack)
    sim.report(env, saved("t1", 1, metric_index=1))
    assert [p.event.step for p in sim.take(ev.Publish) if isinstance(p.event, ev.CheckpointSaved)] == [1]
    sim.report(env, ev.MetricsReported(()))  # a later message: its ack would cover the save too
    assert sim.take(ev.Ack) == []
    sim.out.clear()
    sim.feed(ck.PauseRequested("t1", "paused by the assessor"))  # what the search decided on it
    sim.feed(ck.SavesHeard())
    told = [(type(i.message).__name__ if isinstance(i, ev.Send) else f"Ack {i.link} {i.seq}") for i in sim.out
            if isinstance(i, (ev.Send, ev.Ack))]
    assert told == ["PauseTrial", f"Ack {link} 3"]  # the pause, then the ack of the save and what followed
    sim.out.clear()
    sim.report(env, ev.MetricsReported(()))  # nothing held: acked at once
    assert [(a.link, a.seq) for a in sim.take(ev.Ack)] == [(link, 4)]


def test_a_held_ack_goes_out_at_its_deadline_when_the_search_says_nothing() -> None:
    sim = ready_sim()
    sim.engine.publish_checkpoints, sim.engine.save_hold_s = True, 2.0
    env = running(sim)
    sim.take(ev.Ack)
    sim.report(env, saved("t1", 1, metric_index=1))
    sim.advance(1.0)
    sim.feed(ev.Ticked())
    assert sim.take(ev.Ack) == []
    sim.advance(1.5)
    sim.feed(ev.Ticked())
    assert [a.seq for a in sim.take(ev.Ack)] == [2]


def test_without_a_search_that_judges_saves_nothing_is_held() -> None:
    sim = ready_sim()
    sim.engine.publish_checkpoints = True  # listened to, but no hold asked
    env = running(sim)
    sim.take(ev.Ack)
    sim.report(env, saved("t1", 1, metric_index=1))
    assert [a.seq for a in sim.take(ev.Ack)] == [2]


def test_a_pause_decided_while_the_agents_stream_is_down_is_sent_again_when_it_reconnects() -> None:
    """The PauseTrial of a trial still pausing goes out again after the Welcome of its agent's
    new stream: one sent on a stream that broke, or while none was open, is not lost."""
    sim = ready_sim()
    env = running(sim)
    sim.report(env, saved("t1", 1))
    sim.feed(ev.AgentDisconnected(env, sim.links[env]))
    sim.out.clear()
    sim.feed(ck.PauseRequested("t1", "asha: rung 1"))
    assert sent(sim, ck.PauseTrial) == []  # no stream to send it on
    link = sim.register(env, instance=f"i-{env}-{sim.links[env]}", active=("t1",))
    to_agent = [s.message for s in sim.take(ev.Send) if s.link == link]
    assert isinstance(to_agent[0], ev.Welcome) and "t1" not in to_agent[0].cancel_trial_ids
    pauses = [m for m in to_agent if isinstance(m, ck.PauseTrial)]
    assert [(p.trial_id, p.reason) for p in pauses] == [("t1", "asha: rung 1")]
    # An agent that no longer runs it is not asked to pause it.
    sim.feed(ev.AgentDisconnected(env, link))
    link = sim.register(env, instance=f"i-{env}-{sim.links[env]}", active=())
    assert [m for s in sim.take(ev.Send) if s.link == link for m in [s.message] if isinstance(m, ck.PauseTrial)] == []


def test_a_held_save_stays_held_across_a_reconnect_so_its_pause_lands_at_it() -> None:
    """The stream breaks while a judged save's ack is held: the Welcome of the new stream
    acknowledges only what came before the save, the agent sends the save again, and its
    ack waits, as on the old stream, behind the pause the search decided on it."""
    sim = ready_sim(pause_grace_s=30.0)
    sim.engine.publish_checkpoints, sim.engine.save_hold_s = True, 2.0
    env = running(sim)
    instance = f"i-{env}-{sim.links[env]}"
    sim.take(ev.Ack)
    sim.report(env, saved("t1", 1, metric_index=1))  # seq 2, held
    assert sim.take(ev.Ack) == []
    sim.feed(ev.AgentDisconnected(env, sim.links[env]))
    sim.advance(0.5)
    link = sim.register(env, instance=instance, active=("t1",))
    welcome = next(s.message for s in sim.take(ev.Send) if s.link == link and isinstance(s.message, ev.Welcome))
    assert welcome.acked_seq == 1  # not the save's 2
    sim.feed(ev.AgentReported(env, link, 2, saved("t1", 1, metric_index=1)))  # sent again: stored already
    assert sim.take(ev.Ack) == [] and sim.engine.trials["t1"].checkpoint.step == 1
    sim.out.clear()
    sim.feed(ck.PauseRequested("t1", "paused by the assessor"))
    sim.feed(ck.SavesHeard())
    told = [(type(i.message).__name__ if isinstance(i, ev.Send) else f"Ack {i.link} {i.seq}") for i in sim.out
            if isinstance(i, (ev.Send, ev.Ack))]
    assert told == ["PauseTrial", f"Ack {link} 2"]


def test_a_held_save_whose_time_ran_out_while_the_stream_was_down_is_acknowledged_by_the_welcome() -> None:
    sim = ready_sim()
    sim.engine.publish_checkpoints, sim.engine.save_hold_s = True, 2.0
    env = running(sim)
    instance = f"i-{env}-{sim.links[env]}"
    sim.take(ev.Ack)
    sim.report(env, saved("t1", 1, metric_index=1))
    sim.feed(ev.AgentDisconnected(env, sim.links[env]))
    sim.advance(3.0)
    link = sim.register(env, instance=instance, active=("t1",))
    welcome = next(s.message for s in sim.take(ev.Send) if s.link == link and isinstance(s.message, ev.Welcome))
    assert welcome.acked_seq == 2
    sim.feed(ev.AgentReported(env, link, 2, saved("t1", 1, metric_index=1)))  # a replay: acked at once
    assert [(a.link, a.seq) for a in sim.take(ev.Ack)] == [(link, 2)]
