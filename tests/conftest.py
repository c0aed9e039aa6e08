"""Shared pytest fixtures: each area keeps its own in tests/fixtures_<area>.py, imported here."""

import os
import sys
from pathlib import Path
from typing import Any

import pytest

# The speculators library (for the export round trip) lives outside .venv: its requirements would move
# torch, so `make test` installs it with --no-deps into this folder. Appended last: .venv's packages win.
_SPECULATORS_DIR = Path(__file__).resolve().parents[1] / ".venvs" / "speculators"
if _SPECULATORS_DIR.is_dir():
    sys.path.append(str(_SPECULATORS_DIR))

from fixtures_engine import tiny_stablelm_dir  # noqa: E402, F401
from fixtures_flow import first_cycle, flow_env  # noqa: E402, F401
from fixtures_kernels import trained_pair, zoo_target_dir  # noqa: E402, F401

# `make test` runs the suite on two xdist workers (-n 2 --dist loadscope, with the scheduler below): each
# test file is one unit of work, and the files that share a session fixture too costly to build twice are
# one unit together, on one worker. The two shared units start first: they are the longest.
_UNIT_OF_SHARED_FIXTURE = {"first_cycle": "first-cycle", "trained_pair": "zoo", "zoo_target_dir": "zoo"}
_FIRST_CYCLE_FILES = ["test_browser.py", "test_faults.py", "test_flow.py", "test_refresh.py"]
_FIRST_CYCLE_FILES += ["test_stage_seam.py", "test_sweep.py"]
_ZOO_FILES = ["test_acceptance_training.py", "test_checkpoint_errors.py", "test_contract_up_front.py"]
_ZOO_FILES += ["test_data_input.py", "test_diagnose_cli.py", "test_drafter_contract.py", "test_eagle31.py"]
_ZOO_FILES += ["test_engine_extraction.py", "test_engine_synthesis.py", "test_engine_vllm.py"]
_ZOO_FILES += ["test_evaluation_benchmark.py", "test_evaluation_reproducible.py", "test_evaluation_run.py"]
_ZOO_FILES += ["test_evaluation_simulator.py", "test_extract_actors.py", "test_generic_engine.py"]
_ZOO_FILES += ["test_online_training.py", "test_prompt_selection.py", "test_simulate.py"]
_ZOO_FILES += ["test_train_variant.py", "test_trust_remote_code.py"]
_UNIT_OF_FILE = {name: "first-cycle" for name in _FIRST_CYCLE_FILES} | {name: "zoo" for name in _ZOO_FILES}

if worker := os.environ.get("PYTEST_XDIST_WORKER"):
    # Each worker's local Ray instances keep their session folders apart (RAY_TMPDIR: the driver's default).
    os.environ.setdefault("RAY_TMPDIR", f"/tmp/draftloop-ray-{worker}")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """--dist loadscope: units of work by file and shared fixture (`_UNIT_OF_FILE`), the shared ones first."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return _UNIT_OF_FILE.get(Path(path).name, path)

        def _assign_work_unit(self, node: Any) -> None:
            for unit in ("zoo", "first-cycle"):
                if unit in self.workqueue:
                    self.workqueue.move_to_end(unit, last=False)
            super()._assign_work_unit(node)

    return SharedFixtureScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """On an xdist worker: every file that uses a shared session fixture is in that fixture's unit (else
    the fixture would be built on both workers, or a unit's order would differ from a serial run's)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for item in items:
        for name in item.fixturenames:
            unit = _UNIT_OF_SHARED_FIXTURE.get(name)
            if unit is not None and _UNIT_OF_FILE.get(item.path.name) != unit:
                raise pytest.UsageError(
                    f"{item.path.name} uses the session fixture {name}: list it in tests/conftest.py as "
                    f"one of the {unit!r} unit's files"
                )
