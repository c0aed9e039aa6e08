"""The `diagnose` deployment's one task: a DiagnoseRequest run, its verdict as a Prefect artifact.

Not a cycle stage (nothing is cached or committed): a diagnosis serves what it is given, as it is.
"""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact

from draftloop.infra.evaluation.diagnose import Diagnosis, format_diagnosis
from draftloop.infra.evaluation.diagnose_request import DiagnoseRequest


@task(name="diagnose", retries=0)  # a retry would serve the same folder again: the verdict is the result
def run_diagnosis(request: DiagnoseRequest) -> Diagnosis:
    diagnosis = request.run()
    create_markdown_artifact(
        key="diagnosis",
        markdown=f"# {diagnosis.verdict}\n\n```\n{format_diagnosis(diagnosis)}\n```\n",
        description=f"{request.drafter} on {request.target}: {diagnosis.verdict}",
    )
    return diagnosis
