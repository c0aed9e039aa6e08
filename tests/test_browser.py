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
    "--window-size=1440,1000",
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
            opened.set_viewport_size({"width": 1440, "height": 1000})
            opened.set_default_timeout(UI_TIMEOUT_MS)
            yield opened
            browser.close()
    finally:
        stop_processes([browser_process.pid], grace_s=10)
    assert not is_alive(browser_process.pid)


def _form_field(page: Any, title: str) -> Any:
    """A flow parameter on Prefect's run form, by its title (flows/form.py; the label reads `<title>
    (Optional)`)."""
    # Only the parentheses escaped: playwright hands the pattern to JavaScript, which refuses `\ `.
    pattern = re.sub(r"([()])", r"\\\1", title)
    label = page.locator(".schema-form-property__label", has_text=re.compile(rf"^{pattern} \(Optional\)$"))
    return page.locator(".schema-form-property").filter(has=label)


def _final_flow_run(api: str, deployment_id: str) -> dict[str, Any]:
    """The deployment's one flow run once it is in a final state (the test's own server has no other)."""
    deadline = time.monotonic() + FLOW_RUN_TIMEOUT_S
    while True:
        runs = _deployment_runs(api, deployment_id)
        if runs and runs[0]["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            assert len(runs) == 1, [run["name"] for run in runs]
            run: dict[str, Any] = runs[0]
            return run
        assert time.monotonic() < deadline, f"no final state after {FLOW_RUN_TIMEOUT_S} s: {runs}"
        time.sleep(3)


def _deployment_runs(api: str, deployment_id: str) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = httpx.post(
        f"{api}/flow_runs/filter", json={"deployments": {"id": {"any_": [deployment_id]}}}, timeout=30
    ).json()
    return runs


def _link(page: Any, label: str) -> str:
    """The href of the artifact's link in the row `label` (its cell shows the URL itself)."""
    row = page.get_by_role("row").filter(has_text=label).first
    href: str = row.get_by_role("link").first.get_attribute("href")
    return href


def test_prefect_form_runs_the_flow_and_links_to_mlflow_and_back(
    flow_env: FlowEnv,
    first_cycle: tuple[dict[str, Any], float],
    services: dict[str, Any],
    page: Any,
    screenshots: Path,
) -> None:
    """The `train-and-eval` form, filled in the browser: typed fields (dropdowns, limits: a bad number is
    refused before any run), submitted and run by `draftloop up`'s worker; the run page's artifact links
    the MLflow run and the model version, and the MLflow run links back to the Prefect run. Then
    MLflow's root: model-training mode on the experiment's runs, their figures as columns.

    For CI time the submitted cycle is the session's first cycle again (every stage a cache hit, as in
    the CLI deployment test below): a whole cycle with a registered version in seconds.
    """
    first, _ = first_cycle
    ui = services["prefect-server"].url
    api = f"{ui}/api"
    mlflow = services["mlflow"].url
    deployment = httpx.get(f"{api}/deployments/name/train-and-eval/train-and-eval", timeout=30).json()

    page.goto(f"{ui}/deployments/deployment/{deployment['id']}/run")
    num_samples = _form_field(page, "Training conversations").locator("input").first
    num_samples.wait_for()
    # Choices are dropdowns showing the default config's own values; numbers show theirs.
    for title, shown in (
        ("Config (shipped)", "configs/tiny-llama.yaml"),
        ("Serving engine", "vllm"),
        ("Run up to stage", "register"),
    ):
        # Prefect's p-select renders a native <select> in headless chromium.
        dropdown = _form_field(page, title).locator("select").first
        assert dropdown.input_value() == shown, title
    assert num_samples.input_value() == "256"
    _form_field(page, "Config file (another)").locator("textarea, input").first.fill(
        str(flow_env.config_path)
    )
    # A number below its limit: the form is refused by name, no run is created.
    num_samples.fill("0")
    page.get_by_role("button", name="Submit").click()
    refusal = page.get_by_text(re.compile(r"Validation failed for field 'num_samples'.*minimum of 1")).first
    refusal.wait_for()
    page.screenshot(path=str(screenshots / "prefect-form-refused.png"))
    assert "/run" in page.url and _deployment_runs(api, deployment["id"]) == []
    num_samples.fill("256")  # the default: the config's own value
    page.set_viewport_size({"width": 1440, "height": 2000})  # the form scrolls inside its own pane
    page.screenshot(path=str(screenshots / "prefect-run-form.png"))
    page.get_by_role("button", name="Submit").click()
    page.wait_for_url(re.compile(rf".*/deployments/deployment/{deployment['id']}(\?.*)?$"))
    page.set_viewport_size({"width": 1440, "height": 1000})

    run = _final_flow_run(api, deployment["id"])
    assert run["parameters"]["config_path"] == str(flow_env.config_path)
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
    page.get_by_text(re.compile(r"flow-test")).first.wait_for()
    page.screenshot(path=str(screenshots / "prefect-run-artifact.png"), full_page=True)
    mlflow_run, model_version = _link(page, "MLflow run"), _link(page, "MLflow model version")
    registered = first["registered_model"]
    assert mlflow_run.startswith(f"{mlflow}/#/experiments/") and "/runs/" in mlflow_run
    assert model_version == f"{mlflow}/#/models/{registered['name']}/versions/{registered['version']}"

    # Prefect -> the MLflow run: its description links back, its Source says where it came from.
    page.goto(mlflow_run)
    back = page.get_by_role("link", name="/runs/flow-run/").first  # a substring of its name
    back.wait_for()
    assert back.get_attribute("href") == f"{ui}/runs/flow-run/{run['id']}"
    page.get_by_text("train-and-eval/train-and-eval").first.wait_for()  # Source
    page.screenshot(path=str(screenshots / "mlflow-cycle-run.png"), full_page=True)
    page.goto(str(back.get_attribute("href")))  # MLflow -> back to the Prefect run (it opens a new tab)
    assert page.locator(".state-badge").first.inner_text().strip() == "Completed"

    page.goto(model_version)
    page.get_by_text(f"Version {registered['version']}").first.wait_for()
    page.screenshot(path=str(screenshots / "mlflow-model-version.png"), full_page=True)

    # MLflow's root: model training (the sidebar's Model registry exists only there), on the experiment's
    # runs, the cycle runs' figures as columns.
    page.goto(f"{mlflow}/")
    page.wait_for_url(re.compile(r".*#/experiments/\d+/runs.*"))
    page.get_by_role("link", name="Model registry").first.wait_for()
    headers = page.get_by_role("columnheader")
    headers.filter(has_text="mean_acceptance_length").first.wait_for()
    shown = {" ".join(text.split()) for text in headers.all_inner_texts()}
    for column in ("mean_acceptance_length", "acceptance_pct", "speedup_c1", "gate", "verdict", "Source"):
        assert column in shown, (column, shown)
    cycle_rows = page.get_by_role("row").filter(has_text="flow-test-")
    assert cycle_rows.count() >= 2, cycle_rows.all_inner_texts()  # the first cycle and this run
    page.screenshot(path=str(screenshots / "mlflow-landing.png"), full_page=True)


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


def _clipped(cell: Any, text: str) -> bool:
    """Whether `text` inside `cell` runs past the cell's right edge (cut off by the column)."""
    clipped: bool = cell.evaluate(
        """(cell, text) => {
            const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
            for (let node = walker.nextNode(); node; node = walker.nextNode()) {
                const at = node.textContent.indexOf(text);
                if (at < 0) continue;
                const range = document.createRange();
                range.setStart(node, at);
                range.setEnd(node, at + text.length);
                let box = node.parentElement;  // the nearest box that clips its content
                while (box !== cell && getComputedStyle(box).overflow === "visible") box = box.parentElement;
                return range.getBoundingClientRect().right > box.getBoundingClientRect().right + 1;
            }
            return true;  // not found: as good as cut off
        }""",
        text,
    )
    return clipped


def test_mlflow_registry_page_shows_the_champion_and_the_verdicts(
    flow_env: FlowEnv, services: dict[str, Any], page: Any, screenshots: Path
) -> None:
    """The registered model's page in MLflow's UI at 1440 px: the champion alias on v1, each version's
    row with at most six short tags and its description's figures first, none cut off; the full verdict
    on the version's page."""
    name = "drafter-browser-test"
    champion, rejected = _register_synthetic_versions(flow_env, name)
    assert champion.champion and not rejected.champion
    ui = services["mlflow"].url

    page.set_viewport_size({"width": 1440, "height": 1000})
    page.goto(f"{ui}/#/models/{name}")
    first_row = page.get_by_role("row").filter(has=page.get_by_role("link", name="Version 1", exact=True))
    second_row = page.get_by_role("row").filter(has=page.get_by_role("link", name="Version 2", exact=True))
    first_row.wait_for()
    close_assistant = page.locator('[data-component-id="mlflow.assistant.chat_panel.close"]')
    if close_assistant.count():  # MLflow's assistant panel would cover half the screenshot
        close_assistant.first.click()
    assert "@ champion" in _text(first_row)
    assert "@ champion" not in _text(second_row)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=ui, registry_uri=ui)
    for row, registration in ((first_row, champion), (second_row, rejected)):
        # The row's description cell opens with the figures (`AL 2.24 · 1.90x @ c=1`), not cut off.
        description = row.get_by_role("cell").last
        assert registration.verdict.startswith(_text(description).rstrip(".")), _text(description)
        figures = " · ".join(registration.verdict.split(" · ")[:2])
        assert figures.startswith("AL ") and not _clipped(description, figures), figures
        # At most six tags, each shown whole as a `key: value` chip.
        tags = client.get_model_version(name, registration.version).tags
        chips = row.locator('[data-component-type="tag"][role="status"]')
        shown = {" ".join(chip.inner_text().split()) for chip in chips.all()}
        shown -= {chip for chip in shown if chip.startswith("@ ")}  # the alias chip is a tag too
        assert shown == {f"{key} : {value}" for key, value in tags.items()} and 0 < len(shown) <= 6, shown
        for chip in chips.all():
            whole = "e => [e, ...e.querySelectorAll('*')].every(n => n.scrollWidth <= n.clientWidth + 1)"
            assert chip.evaluate(whole), chip.inner_text()
    assert champion.verdict.startswith("AL 2.24 · 1.90x @ c=1")
    assert rejected.verdict.startswith("AL 1.93 · 1.60x @ c=1") and "rejected" in rejected.verdict
    # The registered model's own description: the leaderboard names the champion.
    page.get_by_text(re.compile(r"Champion: v1, AL 2\.24")).first.wait_for()
    page.screenshot(path=str(screenshots / "mlflow-registry.png"), full_page=True)

    # A published drafter registered as a baseline (`diagnose --register --alias baseline`): its row beside
    # the trained versions, aliased, never champion, its description opening with its figures.
    baseline = _register_baseline(flow_env, name)
    page.reload()  # the same page: its versions are fetched again
    third_row = page.get_by_role("row").filter(has=page.get_by_role("link", name="Version 3", exact=True))
    third_row.wait_for()
    assert "@ baseline" in _text(third_row) and "@ champion" not in _text(third_row)
    cell = _text(third_row.get_by_role("cell").last).rstrip(".")  # the description's head
    description = client.get_model_version(name, baseline.version).description or ""
    assert cell.startswith("AL 2.10") and description.startswith(cell), cell
    assert "external baseline" in description.splitlines()[0]
    page.screenshot(path=str(screenshots / "mlflow-registry-with-baseline.png"), full_page=True)
    assert baseline.version == "3"

    page.goto(f"{ui}/#/models/{name}/versions/2")
    page.get_by_text(rejected.verdict, exact=True).first.wait_for()
    page.screenshot(path=str(screenshots / "mlflow-version-rejected.png"), full_page=True)


def test_deployment_run_from_the_cli_completes_the_cycle(
    flow_env: FlowEnv, first_cycle: tuple[dict[str, Any], float], services: dict[str, Any]
) -> None:
    """`draftloop up` + `prefect deployment run ... --watch`, the README's command: the cycle through the
    same local server and worker as the form above (after it: the form test counts the deployment's runs),
    its --watch output carrying the MLflow links."""
    import json
    import sys

    from draftloop.infra.runtime.services import read_services

    first, _ = first_cycle
    assert set(services) == {"prefect-server", "prefect-worker", "mlflow"}
    recorded = read_services(REPO_ROOT)
    assert {name: svc.pid for name, svc in recorded.items()} == {n: s.pid for n, s in services.items()}
    api = f"{services['prefect-server'].url}/api"
    env = {**flow_env.env, "PREFECT_API_URL": api, "DRAFTLOOP_STATE_DIR": flow_env.env["DRAFTLOOP_STATE_DIR"]}
    prefect = str(Path(sys.executable).parent / "prefect")
    params = json.dumps({"config_path": str(flow_env.config_path)})
    done = subprocess.run(
        [prefect, "deployment", "run", "train-and-eval/train-and-eval", "--params", params, "--watch"],
        env={**os.environ, **env, "COLUMNS": "1000"},  # rich wraps at the width
        cwd=str(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=480,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "Completed" in output, output[-3000:]
    # --watch shows the last log line: the links into the MLflow server `up` started (its SQLite file).
    # (rich breaks a long line at its spaces: read the words)
    words = " ".join(output.split())
    assert f"MLflow run: {services['mlflow'].url}/#/experiments/" in words, output[-3000:]
    assert f"MLflow model version: {services['mlflow'].url}/#/models/" in words, output[-3000:]
    # The worker's run wrote its summary next to the session's first cycle: every stage a cache hit.
    cycles = Path(first["run_folder"]).parent
    summaries = sorted(cycles.glob("*/summary.json"), key=lambda path: path.stat().st_mtime)
    latest = json.loads(summaries[-1].read_text())
    assert latest["status"] == "completed"
    assert sorted(latest["cache_hits"]) == sorted(first["stages"])


def _submit_form(page: Any, ui: str, deployment_id: str, fields: dict[str, str], screenshot: Path) -> None:
    """Open a deployment's run form, fill `fields` (title -> text; JSON fields take JSON) and submit."""
    page.goto(f"{ui}/deployments/deployment/{deployment_id}/run")
    first = next(iter(fields))
    _form_field(page, first).locator("textarea, input").first.wait_for()
    for title, text in fields.items():
        _form_field(page, title).locator("textarea, input").first.fill(text)
    page.set_viewport_size({"width": 1440, "height": 2000})
    page.screenshot(path=str(screenshot))
    page.get_by_role("button", name="Submit").click()
    page.wait_for_url(re.compile(rf".*/deployments/deployment/{deployment_id}(\?.*)?$"))
    page.set_viewport_size({"width": 1440, "height": 1000})


def _artifact_shown(page: Any, ui: str, run_id: str, key: str, text: str, screenshot: Path) -> None:
    page.goto(f"{ui}/runs/flow-run/{run_id}")
    page.get_by_text("Artifacts", exact=True).first.click()
    card = page.locator(".artifact-card", has_text=key)
    card.wait_for()
    card.click()
    page.get_by_text(re.compile(re.escape(text))).first.wait_for()
    page.screenshot(path=str(screenshot), full_page=True)


def test_sweep_and_refresh_forms_run_from_the_browser(
    flow_env: FlowEnv,
    first_cycle: tuple[dict[str, Any], float],
    services: dict[str, Any],
    page: Any,
    screenshots: Path,
) -> None:
    """The `sweep` form (a grid as JSON), then the `refresh` form, submitted in the browser and run by
    `draftloop up`'s worker, each run page showing its artifact.

    For CI time the sweep's grid is over the registered model's name, a key only registration reads:
    both variants are the session's first cycle up to evaluate (cache hits) and the winner is registered
    under its name. Made champion there (as a person promoting it would), it is what the refresh checks
    against 8 new prompts; with a retrain drop of 100% it keeps the champion after the drift report.
    (tests/test_sweep.py and tests/test_refresh.py run both for real.)"""
    import json

    from mlflow import MlflowClient

    assert first_cycle[0]["status"] == "completed"  # the stages the sweep's variants reuse
    ui = services["prefect-server"].url
    api = f"{ui}/api"
    sweep = httpx.get(f"{api}/deployments/name/sweep/sweep", timeout=30).json()
    models = ["drafter-ui-sweep-a", "drafter-ui-sweep-b"]
    _submit_form(
        page,
        ui,
        sweep["id"],
        {
            "Config file (another)": str(flow_env.config_path),
            "Grid: values per config key": json.dumps({"tracking.registered_model": models}),
        },
        screenshots / "prefect-sweep-form.png",
    )
    run = _final_flow_run(api, sweep["id"])
    assert run["state_type"] == "COMPLETED", run["state"].get("message")
    assert run["parameters"]["grid"] == {"tracking.registered_model": models}
    _artifact_shown(
        page,
        ui,
        run["id"],
        "draftloop-sweep-summary",
        "sweep of flow-test",
        screenshots / "prefect-sweep-artifact.png",
    )

    client = MlflowClient(tracking_uri=f"sqlite:///{flow_env.workdir}/mlflow.db")
    (winner,) = [version for name in models for version in client.search_model_versions(f"name='{name}'")]
    client.set_registered_model_alias(winner.name, "champion", winner.version)

    traffic = flow_env.workdir / "ui-traffic"
    traffic.mkdir()
    prompts = [f"Give one tip for learning {topic}." for topic in ("chess", "piano", "Go", "Rust")]
    prompts += [f"Name a city in {country}." for country in ("Peru", "Chad", "Laos", "Oman")]
    (traffic / "log.jsonl").write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n" for text in prompts)
    )
    refresh = httpx.get(f"{api}/deployments/name/refresh/refresh", timeout=30).json()
    assert [schedule["active"] for schedule in refresh["schedules"]] == [False]  # off until turned on
    _submit_form(
        page,
        ui,
        refresh["id"],
        {
            "Config file (another)": str(flow_env.config_path),
            "New traffic (folder or S3 prefix)": str(traffic),
            "Other config values": json.dumps({"tracking.registered_model": winner.name}),
            "Retrain past this drop of acceptance length": "1",
        },
        screenshots / "prefect-refresh-form.png",
    )
    run = _final_flow_run(api, refresh["id"])
    assert run["state_type"] == "COMPLETED", run["state"].get("message")
    _artifact_shown(
        page, ui, run["id"], "draftloop-refresh", "8 new rows", screenshots / "prefect-refresh-artifact.png"
    )
    parents = client.search_runs(
        [client.get_experiment_by_name("draftloop").experiment_id],
        filter_string="tags.`draftloop.kind` = 'refresh'",
    )
    (parent,) = [p for p in parents if p.data.params.get("refresh.traffic") == str(traffic)]
    assert parent.data.tags["draftloop.decision"] == "champion_fits"
    assert "drift.all.mean_acceptance_length" in parent.data.metrics
    assert [v.version for v in client.search_model_versions(f"name='{winner.name}'")] == [winner.version]
