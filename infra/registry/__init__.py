"""The drafter's record in MLflow: runs (runs.py), the gate (gate.py), the prose people read (cards.py),
the logged model and its registered versions (models.py); figures.py writes numbers for people.

Set here, before any module of the package imports mlflow: no telemetry from tests or the demo, and no
download progress bars in logs.
"""

import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
