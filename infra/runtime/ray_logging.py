"""Ray worker setup hook (`worker_process_setup_hook` in `ensure_ray`): quiet Ray Train's known noise.

A module of its own, importing only `logging`, because every Ray worker process runs the hook.
"""

from __future__ import annotations

import logging

# Ray Train's placement-group cleaner (a detached actor) asks the State API every second whether the
# training controller is alive; without the dashboard (`include_dashboard=False`) that API is absent and
# each poll logs "Failed to query Ray Train Controller actor state". It keeps monitoring regardless.
RAY_TRAIN_CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"


def quiet_ray_train_cleaner() -> None:
    """Keep only the cleaner's errors: its State API warnings say nothing a user can act on here."""
    logging.getLogger(RAY_TRAIN_CLEANER_LOGGER).setLevel(logging.ERROR)
