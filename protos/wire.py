"""Constants the agent and the coordinator's side share: one definition each.

Standard library only and free of protobuf, so that ``trialkeeper.agent`` (imported by
trial scripts for the SDK) stays cheap to import and a service that only starts agents
needs no gRPC.
"""

from __future__ import annotations

#: The version of the agent <-> coordinator protocol; both ends must speak the same.
PROTOCOL_VERSION = 2
#: The environment variable that carries the experiment token to an agent (never argv).
TOKEN_ENV = "TRIALKEEPER_TOKEN"
#: The gRPC metadata key under which an agent presents the experiment token.
TOKEN_METADATA_KEY = "x-trialkeeper-token"
#: The trailing metadata key of a refusal that says why more than its status can, and its
#: value for an agent that had left its environment (it sent Leaving, the ack was lost) and
#: dials again: that agent exits as cleanly as it meant to.
REFUSAL_METADATA_KEY = "x-trialkeeper-refusal"
REFUSED_AS_LEFT = "left"
#: Set in an agent's environment by services that start it, so that ``clean`` and the
#: cloud platforms can tell whose agent a process or job is.
EXPERIMENT_ENV = "TRIALKEEPER_EXPERIMENT_ID"
ENVIRONMENT_ENV = "TRIALKEEPER_ENVIRONMENT_ID"
#: The trial parameters NNI's PBT tuner names a trial's checkpoints by: the path it loads
#: its state from and the one it saves it to. The coordinator's search follows which trial
#: saved under each; the agent points them at directories of the trial's own.
PBT_LOAD = "load_checkpoint_dir"
PBT_SAVE = "save_checkpoint_dir"
