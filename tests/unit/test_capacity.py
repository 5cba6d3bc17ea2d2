"""The scheduler's view of the fleet (engine/capacity.py): what each environment can take,
refreshed only for the environments said to have changed, and the most GPUs one offers,
asked anew only when an environment's status or agent changed."""

from __future__ import annotations

from trialkeeper.coordinator.engine.capacity import Capacity
from trialkeeper.coordinator.engine.model import EnvState
from trialkeeper.coordinator.engine.policy import PlatformPolicy, Policy
from trialkeeper.coordinator.engine.scheduler import GpuSlot
from trialkeeper.coordinator.engine.states import EnvStatus


def _policy(*platforms: PlatformPolicy) -> Policy:
    return Policy(experiment_id="exp", trial_concurrency=4,
                  platforms=platforms or (PlatformPolicy("local", True, 2, 2),))


def _env(env_id: str, *, platform: str = "local", link: int | None = 1, gpus: int = 0,
         status: EnvStatus = EnvStatus.READY) -> EnvState:
    return EnvState(env_id, status, single_use=False, trial_slots=2, platform=platform, link=link,
                    instance_id=f"inst-{env_id}", gpus=[GpuSlot(f"{env_id}-{i}", i) for i in range(gpus)])


def test_a_new_environment_is_seen_and_handed_to_the_waiting_index_once() -> None:
    envs = {"e1": _env("e1")}
    cap = Capacity(envs, _policy())
    views = cap.views()
    assert set(views) == {"e1"} and views["e1"].accepting and views["e1"].free_slots() == 2
    assert cap.take_changed() == {"e1"}
    assert cap.take_changed() == set()
    envs["e2"] = _env("e2")  # the fleet's own dict grows
    assert set(cap.views()) == {"e1", "e2"}
    assert cap.take_changed() == {"e2"}


def test_a_view_is_refreshed_only_when_its_environment_is_said_to_have_changed() -> None:
    envs = {"e1": _env("e1")}
    cap = Capacity(envs, _policy())
    cap.views()
    envs["e1"].holders.add("t1")
    envs["e1"].draining = True
    assert cap.views()["e1"].accepting  # not told yet: the view stands
    cap.changed("e1")
    view = cap.views()["e1"]
    assert not view.accepting and view.holders == {"t1"} and view.free_slots() == 1
    assert cap.take_changed() == {"e1"}


def test_what_makes_an_environment_take_no_trial() -> None:
    unusable = PlatformPolicy("gone", True, 1, 1, unusable="its SDK is missing")
    envs = {
        "ready": _env("ready"),
        "busy": _env("busy", status=EnvStatus.BUSY),
        "starting": _env("starting", status=EnvStatus.STARTING),
        "no-agent": _env("no-agent", link=None),
        "shut": _env("shut"),
        "used": _env("used"),
        "adopted": _env("adopted", platform="gone"),
    }
    envs["shut"].shutdown_sent = True
    envs["used"].single_use, envs["used"].used = True, True
    cap = Capacity(envs, _policy(PlatformPolicy("local", True, 2, 2), unusable))
    accepting = {k for k, v in cap.views().items() if v.accepting}
    assert accepting == {"ready", "busy"}


def test_the_gpus_offered_are_asked_anew_only_when_a_status_or_agent_changed() -> None:
    envs = {"e1": _env("e1", gpus=2)}
    cap = Capacity(envs, _policy())
    assert cap.gpus_offered() == 2
    envs["e1"].gpus.append(GpuSlot("e1-2", 2))
    assert cap.gpus_offered() == 2  # kept: nothing said its status or agent changed
    cap.status_changed("e1")
    assert cap.gpus_offered() == 3
    assert "e1" in cap.take_changed()
    envs["e2"] = _env("e2", gpus=4)  # a new environment counts at once
    assert cap.gpus_offered() == 4


def test_without_registered_agents_the_simulated_gpus_of_every_platform_answer() -> None:
    cap = Capacity({}, _policy(PlatformPolicy("a", True, 1, 1, simulated_gpus=2),
                               PlatformPolicy("b", True, 1, 1, simulated_gpus=3)))
    assert cap.gpus_offered() == 3
    unknown = Capacity({}, _policy(PlatformPolicy("a", True, 1, 1, simulated_gpus=2), PlatformPolicy("b", True, 1, 1)))
    assert unknown.gpus_offered() is None  # only b's agents can tell, once they register
