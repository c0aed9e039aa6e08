"""Shared pytest fixtures: each area keeps its own in tests/fixtures_<area>.py, imported here."""

from fixtures_flow import first_cycle, flow_env  # noqa: F401
from fixtures_kernels import trained_pair, zoo_target_dir  # noqa: F401
from fixtures_engine import engine_zoo_target, tiny_stablelm_dir  # noqa: F401
