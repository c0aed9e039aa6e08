"""Which stage failures Prefect retries, and the `@task` options every stage shares.

Engine start-up, S3 and network faults are worth a retry (with exponential backoff); config errors,
bugs and engines that logged a fatal pattern are not: they would fail the same way again.
"""

from __future__ import annotations

import http.client
from typing import Any

import botocore.exceptions
import httpx
import requests
import urllib3.exceptions
from prefect import Task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.states import State
from prefect.tasks import exponential_backoff

from draftloop.infra.engines.server import EngineStartError

_TRANSIENT: tuple[type[BaseException], ...] = (
    ConnectionError,
    TimeoutError,
    httpx.TransportError,
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectionClosedError,
    # A server that went away mid-response (the MLflow client's requests: "Connection broken:
    # IncompleteRead"), not only one that refused the connection.
    requests.exceptions.ConnectionError,
    requests.exceptions.ChunkedEncodingError,
    urllib3.exceptions.ProtocolError,
    http.client.IncompleteRead,
)


def is_transient(error: BaseException | None) -> bool:
    """True when `error` or one of its causes is a fault that may pass on a retry."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, EngineStartError):
            # A server that timed out or died without a known fatal log line may come up next time;
            # one that logged a fatal pattern (bad flag, OOM, wrong drafter) will not.
            return error.pattern is None
        if isinstance(error, _TRANSIENT):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def retry_if_transient(_task: Task[Any, Any], _task_run: TaskRun, state: State[Any]) -> bool:
    """Prefect `retry_condition_fn`: retry only when the failure (or its cause) is transient."""
    try:
        state.result(raise_on_failure=True)
    except BaseException as error:
        return is_transient(error)
    return False


def stage_task_options(retries: int = 2) -> dict[str, Any]:
    """Keyword arguments for a stage's `@task`: retries with backoff, no Prefect result cache.

    Caching is ours (committed manifests in storage, tasks/cache.py), not Prefect's result store.
    """
    return {
        "retries": retries,
        "retry_delay_seconds": exponential_backoff(backoff_factor=5),
        "retry_jitter_factor": 0.2,
        "retry_condition_fn": retry_if_transient,
        "cache_policy": NO_CACHE,
        "persist_result": False,
    }
