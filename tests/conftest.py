"""Put ``tests/helpers`` on ``sys.path`` once for every suite, so that tests import the shared helpers
(``builders``, ``inprocess``, ``live_server``, ``engine_models``) by module name without a test package."""

from __future__ import annotations

import sys
from pathlib import Path

HELPERS = str(Path(__file__).resolve().parent / "helpers")
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)
