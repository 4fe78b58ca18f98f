"""Moved to `nbexec.integrations.tools`; this name keeps working for one release."""

import sys
import warnings

from .integrations import tools as _moved

warnings.warn("nbexec.tools moved to nbexec.integrations.tools; import it from there", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
