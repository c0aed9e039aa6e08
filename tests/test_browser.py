"""What a person sees, in Debian's chromium driven by playwright: the Prefect form and run page, the MLflow
registry page. Both read the same `draftloop up` stack (tests/fixtures_flow.py local_services).

Screenshots are written to $DRAFTLOOP_TEST_ARTIFACTS, or tests-artifacts/browser/ in the repository (the
folder is printed). Chromium is started here, by PID, and stopped by PID; playwright attaches over CDP.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fixtures_flow import REPO_ROOT, FlowEnv, local_services
from fixtures_registry import drafter_card, fake_drafter

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",  # tests run as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",  # chromium picks a free port and writes it to DevToolsActivePort
    "--window-size=1400,1000",
]
FLOW_RUN_TIMEOUT_S = 420
UI_TIMEOUT_MS = 120_000  # the UIs render slowly on a busy 2-core machine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason=f"{CHROMIUM} is absent (`make browser` installs Debian's chromium)"
    ),
]


@pytest.fixture(scope="module")
def screenshots() -> Path:
    folder = Path(os.environ.get("DRAFTLOOP_TEST_ARTIFACTS") or REPO_ROOT / "tests-artifacts") / "browser"
    folder.mkdir(parents=True, exist_ok=True)
    print(f"\nbrowser screenshots: {folder}")
    return folder


@pytest.fixture(scope="module")
def services(flow_env: FlowEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with local_services(flow_env, tmp_path_factory.mktemp("browser-services")) as started:
        yield started


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A page of a headless chromium with a fresh profile, the browser stopped by PID at the end."""
    from playwright.sync_api import sync_playwright

    from draftloop.infra.runtime.processes import is_alive, stop_processes

    profile = tmp_path_factory.mktemp("chromium-profile")
    log = profile.parent / "chromium.log"
    with open(log, "wb") as output:
        browser_process = subprocess.Popen(
            [str(CHROMIUM), *CHROMIUM_ARGS, f"--user-data-dir={profile}", "about:blank"],
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: its renderers are stopped with it
        )
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            assert browser_process.poll() is None, log.read_text(errors="replace")[-2000:]
            assert time.monotonic() < deadline, f"chromium wrote no DevToolsActivePort; log {log}"
            time.sleep(0.2)
        port = port_file.read_text().split()[0]
        with sync_playwright() as playwright:
            browser = playwright.chromium.connect_over_cdp(f"http://127.0.0.1:{port}")
            opened = browser.contexts[0].new_page()
            opened.set_viewport_size({"width": 1400, "height": 1000})
            opened.set_default_timeout(UI_TIMEOUT_MS)
            yield opened
            browser.close()
    finally:
        stop_processes([browser_process.pid], grace_s=10)
    assert not is_alive(browser_process.pid)


def _form_field(page: Any, name: str) -> Any:
    """The input of a flow parameter on Prefect's run form (its label reads `<name> (Optional)`)."""
    label = page.locator(".schema-form-property__label", has_text=re.compile(rf"^{name} \(Optional\)$"))
    return page.locator(".schema-form-property").filter(has=label).locator("input, textarea").first


def _final_flow_run(api: str, deployment_id: str) -> dict[str, Any]:
    """The deployment's one flow run once it is in a final state (the test's own server has no other)."""
    deadline = time.monotonic() + FLOW_RUN_TIMEOUT_S
    while True:
        runs = httpx.post(
            f"{api}/flow_runs/filter", json={"deployments": {"id": {"any_": [deployment_id]}}}, timeout=30
        ).json()
        if runs and runs[0]["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            assert len(runs) == 1, [run["name"] for run in runs]
            run: dict[str, Any] = runs[0]
            return run
        assert time.monotonic() < deadline, f"no final state after {FLOW_RUN_TIMEOUT_S} s: {runs}"
        time.sleep(3)


def test_prefect_form_runs_the_flow_and_its_page_shows_the_summary(
    flow_env: FlowEnv, services: dict[str, Any], page: Any, screenshots: Path
) -> None:
    """The `train-and-eval` deployment's run form, filled and submitted in the browser; the worker of
    `draftloop up` runs it; the run page shows Completed and the cycle-summary artifact.

    Covers the form (flat fields showing the config's defaults), the deployment served by a process
    worker, and the run page with its artifact. For CI time it runs the cheapest cycle the flow allows:
    `until = extract` on 8 samples (synthesize with the target, extract its hidden states), not training
    or evaluation, which tests/test_flow.py and test_flow_deployment.py cover.
    """
    ui = services["prefect-server"].url
    api = f"{ui}/api"
    deployment = httpx.get(f"{api}/deployments/name/train-and-eval/train-and-eval", timeout=30).json()

    page.goto(f"{ui}/deployments/deployment/{deployment['id']}/run")
    num_samples = _form_field(page, "num_samples")
    num_samples.wait_for()
    # The form shows the default config's own values, no type toggles to click first.
    assert num_samples.input_value() == "256"
    assert _form_field(page, "engine_kind").input_value() == "vllm"
    assert _form_field(page, "until").input_value() == "register"
    _form_field(page, "config").fill(str(flow_env.config_path))
    num_samples.fill("8")
    _form_field(page, "until").fill("extract")
    # The form scrolls inside its own pane: a window tall enough shows every field at once.
    page.set_viewport_size({"width": 1400, "height": 2000})
    page.screenshot(path=str(screenshots / "prefect-run-form.png"))
    page.get_by_role("button", name="Submit").click()
    # Submitted: the UI leaves the form for the deployment's page.
    page.wait_for_url(re.compile(rf".*/deployments/deployment/{deployment['id']}(\?.*)?$"))
    page.set_viewport_size({"width": 1400, "height": 1000})

    run = _final_flow_run(api, deployment["id"])
    assert run["parameters"]["num_samples"] == 8 and run["parameters"]["until"] == "extract"
    assert run["state_type"] == "COMPLETED", run["state"].get("message")

    page.goto(f"{ui}/runs/flow-run/{run['id']}")
    badge = page.locator(".state-badge").first
    badge.wait_for()
    assert badge.inner_text().strip() == "Completed"
    page.get_by_text("Artifacts", exact=True).first.click()
    card = page.locator(".artifact-card", has_text="draftloop-cycle-summary")
    card.wait_for()
    page.screenshot(path=str(screenshots / "prefect-run-page.png"), full_page=True)
    card.click()
    # The artifact's own page renders its markdown: the cycle's status and a row per stage run.
    page.get_by_text(re.compile(r"flow-test.*completed")).first.wait_for()
    for stage in ("synthesize", "extract"):
        assert page.get_by_text(stage, exact=True).count() >= 1, stage
    page.screenshot(path=str(screenshots / "prefect-run-artifact.png"), full_page=True)


def _register_synthetic_versions(flow_env: FlowEnv, name: str) -> list[Any]:
    """Two versions through the project's own registration: v1 becomes champion, v2 is rejected."""
    from draftloop.infra.registry.gate import CycleResults
    from draftloop.infra.registry.models import register_drafter
    from draftloop.infra.registry.runs import Tracker
    from draftloop.infra.runtime.config import GateConfig

    tracker = Tracker(
        f"sqlite:///{flow_env.workdir}/mlflow.db", str(flow_env.workdir / "mlartifacts"), "browser-registry"
    )
    card = drafter_card("tiny-llama", "ab" * 32)
    registrations = []
    for version, length, speedup in (("v1", 2.24, 1.9), ("v2", 1.93, 1.6)):
        drafter = fake_drafter(flow_env.workdir / "browser-drafters" / version)
        rate = (length - 1) / 3
        results = CycleResults(
            acceptance_rate=rate,
            mean_acceptance_length=length,
            speedup={1: speedup},
            throughput={1: 100.0},
            simulator_acceptance_rate=rate,
            consistent=True,
            lossless=True,
            recommended_k=3,
        )
        tracker.start_cycle(f"browser-{version}", {}, {})
        with tracker.stage("register") as run:
            registrations.append(
                register_drafter(
                    tracker,
                    run,
                    name,
                    GateConfig(min_acceptance_length=1.5),
                    results,
                    card,
                    drafter,
                    serving_command=lambda source: f"vllm serve tiny-llama --speculative-model {source}",
                )
            )
        tracker.end_cycle()
    return registrations


def _register_baseline(flow_env: FlowEnv, name: str) -> Any:
    """A published drafter's diagnosis registered as an external baseline (the diagnosis given here)."""
    from draftloop.infra.evaluation.diagnose import Diagnosis, FolderReading, Reading, ReadingFigures
    from draftloop.infra.registry.external import register_external
    from draftloop.infra.registry.runs import Tracker

    tracker = Tracker(
        f"sqlite:///{flow_env.workdir}/mlflow.db", str(flow_env.workdir / "mlartifacts"), "browser-registry"
    )
    folder = fake_drafter(flow_env.workdir / "browser-drafters" / "published")
    reading = Reading("vllm reads [1, 3, 5] as layer_input", (1, 3, 5), engine_reads=True, trained=True)
    diagnosis = Diagnosis(
        verdict="ok",
        reasons=[],
        folder=FolderReading(str(folder), "speculators", [1, 3, 5], None, "speculators format"),
        engine={"acceptance_rate": 0.3667, "mean_acceptance_length": 2.10, "per_position": []},
        readings=[ReadingFigures(reading, 0.3667, 2.10, [])],
        speedup={"1": {"speedup": 1.7, "status": "ok"}},
    )
    return register_external(tracker, name, diagnosis, "vllm", 3, alias="baseline")


def _text(locator: Any) -> str:
    return " ".join(locator.inner_text().split())  # the alias tag is "@&nbsp;champion"


def test_mlflow_registry_page_shows_the_champion_and_the_verdicts(
    flow_env: FlowEnv, services: dict[str, Any], page: Any, screenshots: Path
) -> None:
    """The registered model's page in MLflow's UI: the champion alias on v1, each version's description
    opening with its one-line verdict, and the full verdict on the version's page."""
    name = "drafter-browser-test"
    champion, rejected = _register_synthetic_versions(flow_env, name)
    assert champion.champion and not rejected.champion
    ui = services["mlflow"].url

    page.goto(f"{ui}/#/models/{name}")
    first_row = page.get_by_role("row").filter(has=page.get_by_role("link", name="Version 1", exact=True))
    second_row = page.get_by_role("row").filter(has=page.get_by_role("link", name="Version 2", exact=True))
    first_row.wait_for()
    close_assistant = page.locator('[data-component-id="mlflow.assistant.chat_panel.close"]')
    if close_assistant.count():  # MLflow's assistant panel would cover half the screenshot
        close_assistant.first.click()
    assert "@ champion" in _text(first_row)
    assert "@ champion" not in _text(second_row)
    # The versions list cuts the description to its first characters: the verdict's head.
    description_cells = {
        "1": _text(first_row.get_by_role("cell").last),
        "2": _text(second_row.get_by_role("cell").last),
    }
    assert champion.verdict.startswith("champion: AL 2.24, speedup 1.90x @ c=1 on vLLM 0.32.0")
    assert champion.verdict.startswith(description_cells["1"].rstrip(".")), description_cells
    assert rejected.verdict.startswith("rejected (mean acceptance length 1.93 does not beat champion v1")
    assert rejected.verdict.startswith(description_cells["2"].rstrip(".")), description_cells
    # The registered model's own description: the leaderboard names the champion.
    page.get_by_text(re.compile(r"Champion: v1, AL 2\.24")).first.wait_for()
    page.screenshot(path=str(screenshots / "mlflow-registry.png"), full_page=True)

    # A published drafter registered as a baseline (`diagnose --register --alias baseline`): its row beside
    # the trained versions, aliased, never champion, its description opening with what it is.
    baseline = _register_baseline(flow_env, name)
    page.reload()  # the same page: its versions are fetched again
    third_row = page.get_by_role("row").filter(has=page.get_by_role("link", name="Version 3", exact=True))
    third_row.wait_for()
    assert "@ baseline" in _text(third_row) and "@ champion" not in _text(third_row)
    cell = _text(third_row.get_by_role("cell").last).rstrip(".")  # the description's head
    head = "external baseline: ok, AL 2.100 on vllm"
    assert cell.startswith("external baseline") and head.startswith(cell[: len(head)]), cell
    page.get_by_text(re.compile(r"external baseline")).first.wait_for()
    page.screenshot(path=str(screenshots / "mlflow-registry-with-baseline.png"), full_page=True)
    assert baseline.version == "3"

    page.goto(f"{ui}/#/models/{name}/versions/2")
    page.get_by_text(rejected.verdict, exact=True).first.wait_for()
    page.screenshot(path=str(screenshots / "mlflow-version-rejected.png"), full_page=True)
