"""Installs bench/stages/probes.py into every Python process started with this folder on PYTHONPATH (the
server, its workers and its engine process) when STAGE_MARKS_LIB names the built marks library."""

import os
import sys

if os.environ.get("STAGE_MARKS_LIB"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import probes

    probes.install_from_environment()
