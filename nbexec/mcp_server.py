"""Moved to `nbexec.integrations.mcp`; this name keeps working for one release."""

import sys
import warnings

from .integrations import mcp as _moved

warnings.warn("nbexec.mcp_server moved to nbexec.integrations.mcp; import it from there", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
