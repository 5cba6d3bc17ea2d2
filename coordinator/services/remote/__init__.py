"""The remote platform: agents started over SSH on the machines of ``machineList``."""
