"""Shared pytest fixtures: each area keeps its own in tests/fixtures_<area>.py, imported here."""

import sys
from pathlib import Path

# The speculators library (for the export round trip) lives outside .venv: its requirements would move
# torch, so `make test` installs it with --no-deps into this folder. Appended last: .venv's packages win.
_SPECULATORS_DIR = Path(__file__).resolve().parents[1] / ".venvs" / "speculators"
if _SPECULATORS_DIR.is_dir():
    sys.path.append(str(_SPECULATORS_DIR))

from fixtures_engine import tiny_stablelm_dir  # noqa: E402, F401
from fixtures_flow import first_cycle, flow_env  # noqa: E402, F401
from fixtures_kernels import trained_pair, zoo_target_dir  # noqa: E402, F401
