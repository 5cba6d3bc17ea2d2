"""Environment services, one module per platform with its config beside it.

Which service a platform name stands for is `coordinator.platforms`' business; this
package re-exports its `create_service` for callers that know it from here.
"""

from __future__ import annotations

from ..platforms import ENTRY_POINT_GROUP, create_service

__all__ = ["ENTRY_POINT_GROUP", "create_service"]
