"""The trialkeeper agent: runs trials in an environment for a coordinator.

Importing this package stays cheap (standard library only): trial scripts import the SDK
from here, ``from trialkeeper.agent import trial``.
"""

__version__ = "0.1.0"
PROTOCOL_VERSION = 1
