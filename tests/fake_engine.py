"""An engine added the way a new engine is added: this one module, no other file touched.

`FakeEngine` (kind "fake") serves with tests/fake_engine_server.py, which starts in about a second and
speaks the OpenAI HTTP surface plus its own `fake_spec_*` counters on /metrics. It reads layer ids in the
layer_output convention and adds a `fake_engine` block to the drafters it exports, so a test can tell
that export, layer-id reading and metric parsing all went through this class.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from draftloop.infra.engines.base import (
    Engine,
    FatalPattern,
    ServerSpec,
    parse_prometheus,
    register_engine,
)
from draftloop.infra.runtime.config import EngineConfig
from draftloop.kernels.counters import SpecCounters
from draftloop.kernels.layer_ids import LayerIds

FAKE_SERVER = Path(__file__).resolve().parent / "fake_engine_server.py"
METRIC_PREFIX = "fake_spec_"
DOCTOR_PATCH = {"name": "eagle3_enabler", "status": "applied", "detail": "fake"}


@register_engine
class FakeEngine(Engine):
    kind = "fake"
    layer_id_convention = "layer_output"
    engine_fatal_patterns = (
        FatalPattern(
            "fake_refused", r"fake engine refuses the drafter.*", "the fake server was told to fail"
        ),
    )

    def server_env(self, run_dir: Path) -> dict[str, str]:
        return {"PYTHONUNBUFFERED": "1"}

    def server_command(self, spec: ServerSpec) -> list[str]:
        argv = [
            str(self.python),
            str(FAKE_SERVER),
            "--port",
            str(spec.port),
            "--served-model-name",
            spec.served_model_name,
        ]
        if spec.speculation is not None:
            argv.append("--speculative")
        return argv + list(self.settings.extra_args)

    def user_serving_command(self, target: str, drafter: str, num_speculative_tokens: int) -> str:
        return f"fake-serve {target} --drafter {drafter} --k {num_speculative_tokens}"

    def export_config(self, exported_ids: LayerIds) -> dict[str, Any]:
        return {"fake_engine": {"aux_layer_ids": list(exported_ids.ids)}}

    def parse_metrics(self, text: str) -> SpecCounters | None:
        values: dict[str, float] = {}
        per_position: dict[int, float] = {}
        for name, labels, value in parse_prometheus(text):
            if not name.startswith(METRIC_PREFIX):
                continue
            if name == METRIC_PREFIX + "accepted_per_position":
                per_position[int(labels["position"])] = value
            else:
                values[name.removeprefix(METRIC_PREFIX)] = value
        if not values:
            return None
        return SpecCounters(
            num_drafts=values.get("drafts", 0.0),
            num_draft_tokens=values.get("draft_tokens", 0.0),
            num_accepted_tokens=values.get("accepted_tokens", 0.0),
            accepted_per_position=tuple(per_position[i] for i in sorted(per_position)),
        )

    def version_probe_code(self) -> str:
        return "print('fake-0.1')"

    def doctor_command(self, target_dir: Path, drafter_dir: Path | None) -> list[str]:
        # A probe in the engine's Python: it "applied" the one patch it knows.
        report = {"engine_version": "fake-0.1", "patches": [DOCTOR_PATCH]}
        return [str(self.python), "-c", f"print('DRAFTLOOP_DOCTOR ' + {json.dumps(json.dumps(report))})"]


def fake_engine(*extra_args: str, timeout_s: float = 60.0) -> Engine:
    """A FakeEngine running its server with this interpreter; `extra_args` go to the fake server."""
    section = EngineConfig(
        kind=FakeEngine.kind, python=sys.executable, extra_args=list(extra_args), startup_timeout_s=timeout_s
    )
    return FakeEngine(section.settings(trust_remote_code=False))
