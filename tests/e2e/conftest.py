"""The live-server helpers are shared with tests/security and tests/reliability (tests/helpers)."""

from __future__ import annotations

import sys
from pathlib import Path

HELPERS = str(Path(__file__).resolve().parents[1] / "helpers")
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)
