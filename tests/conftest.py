"""Shared pytest fixtures: each area keeps its own in tests/fixtures_<area>.py, imported here."""

import os
import sys
from pathlib import Path

import pytest

# The speculators library (for the export round trip) lives outside .venv: its requirements would move
# torch, so `make test` installs it with --no-deps into this folder. Appended last: .venv's packages win.
_SPECULATORS_DIR = Path(__file__).resolve().parents[1] / ".venvs" / "speculators"
if _SPECULATORS_DIR.is_dir():
    sys.path.append(str(_SPECULATORS_DIR))

from fixtures_engine import tiny_stablelm_dir  # noqa: E402, F401
from fixtures_flow import first_cycle, flow_env  # noqa: E402, F401
from fixtures_kernels import trained_pair, zoo_target_dir  # noqa: E402, F401

# `make test` runs the suite on two xdist workers (-n 2 --dist loadgroup): each group below runs whole on
# one worker, so a session fixture is built once and tests that start `draftloop up` services never
# overlap. A file is one group at least (its module fixtures are built once).
_GROUP_OF_FIXTURE = {"flow_env": "flow", "first_cycle": "flow"}
_GROUP_OF_FIXTURE |= {"trained_pair": "zoo", "zoo_target_dir": "zoo"}
# Files that start `draftloop up` (Prefect, its worker, MLflow) run beside the flow tests, one at a time.
_FLOW_FILES = {"test_browser.py", "test_cycle_run.py", "test_flow_cluster.py", "test_flow_form.py"}
_FLOW_FILES |= {"test_services_up.py", "test_status_cmd.py"}

if worker := os.environ.get("PYTEST_XDIST_WORKER"):
    # Each worker's local Ray instances keep their sessions apart (RAY_TMPDIR is the driver's default).
    os.environ.setdefault("RAY_TMPDIR", f"/tmp/draftloop-ray-{worker}")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with its file's xdist group (read before xdist names the work units)."""
    groups_in_file: dict[str, set[str]] = {}
    for item in items:
        found = groups_in_file.setdefault(item.path.name, set())
        found |= {_GROUP_OF_FIXTURE[name] for name in item.fixturenames if name in _GROUP_OF_FIXTURE}
        if item.path.name in _FLOW_FILES:
            found.add("flow")
    for item in items:
        found = groups_in_file[item.path.name]
        group = "flow" if "flow" in found else "zoo" if "zoo" in found else item.path.name
        item.add_marker(pytest.mark.xdist_group(group))
