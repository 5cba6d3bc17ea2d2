"""The trialkeeper agent: runs trials in an environment for a coordinator.

Importing this package stays cheap (standard library only): trial scripts import the SDK
from here, ``from trialkeeper.agent import trial``.
"""

# Re-exported: the remote helper reads it from this package on the machines it checks.
from trialkeeper.protos.wire import PROTOCOL_VERSION  # noqa: F401

__version__ = "0.1.0"
