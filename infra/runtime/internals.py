"""The three places draftloop reads another library's internals, each for want of a public API.

Two serve the same purpose: recording the PIDs of processes this driver started, so that a run that
is killed can have them stopped by the next one (infra/runtime/processes.py). The third reads the
object store's usage and spilled bytes (online training reports both and refuses to thrash).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class ObjectStoreStats:
    """Ray's object stores, summed over the cluster's nodes."""

    used_bytes: int
    capacity_bytes: int  # used + available
    spilled_bytes_total: int  # since the cluster started


def object_store_stats() -> ObjectStoreStats:
    """The cluster's object store usage now (the connected Ray's GCS; no dashboard needed)."""
    # Ray's public state API needs the dashboard, which draftloop does not start; `ray memory` reads
    # the same reply through these helpers.
    import ray
    import ray._private.internal_api as internal_api

    address = ray.get_runtime_context().gcs_address
    stats = internal_api.get_memory_info_reply(internal_api.get_state_from_address(address)).store_stats
    used = int(stats.object_store_bytes_used)
    return ObjectStoreStats(used, used + int(stats.object_store_bytes_avail), int(stats.spilled_bytes_total))


def ray_head_pids() -> list[int]:
    """PIDs of the Ray head processes `ray.init` started in this process (none when only connected)."""
    # Ray exposes no public handle on the processes of the node it started.
    import ray._private.worker as ray_worker

    node = ray_worker._global_node
    if node is None:
        return []
    return [info.process.pid for infos in node.all_processes.values() for info in infos if info.process]


def ephemeral_prefect_server_pids() -> list[int]:
    """PIDs of the temporary Prefect servers this process started (one per port; none with an API URL)."""
    # Not imported (seconds of start-up) unless Prefect started a server in this process already.
    server_module = sys.modules.get("prefect.server.api.server")
    if server_module is None:
        return []
    # Prefect keeps its ephemeral servers in this registry and has no public one.
    return [
        server.server_process.pid
        for server in server_module.SubprocessASGIServer._instances.values()
        if server.server_process is not None and server.server_process.poll() is None
    ]
