"""Moved to `nbexec.service.server`; this name keeps working for one release."""

import sys
import warnings

from .service import server as _moved

warnings.warn("nbexec.server moved to nbexec.service.server; import it from there", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
