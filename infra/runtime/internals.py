"""The two places draftloop reads another library's internals, each for want of a public API.

Both serve the same purpose: recording the PIDs of processes this driver started, so that a run that
is killed can have them stopped by the next one (infra/runtime/processes.py).
"""

from __future__ import annotations

import sys


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
