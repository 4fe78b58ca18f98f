"""Moved to `nbexec.integrations.toolcall`; this name keeps working for one release."""

import sys
import warnings

from .integrations import toolcall as _moved

warnings.warn("nbexec.toolcall moved to nbexec.integrations.toolcall; import it from there", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
