"""Constants of the wire contract that the agent and the coordinator share."""

PROTOCOL_VERSION = 1
