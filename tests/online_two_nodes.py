"""Online training on a two-node Ray cluster on this machine (Ray's own multi-node test cluster): the
producers on the node that holds the target (a custom resource), the trainer on the other, each node
with its own object store. Run as a script by tests/test_online_training.py; writes WORK_DIR/found.json
(a file, not stdout: Ray's workers log to the same stream and a line of theirs once ran into the JSON).

usage: online_two_nodes.py TARGET_DIR WORK_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ray
from ray.cluster_utils import Cluster
from test_extract_actors import _conversations, _synthesized
from test_online_training import SAMPLES, _config

from draftloop.infra.runtime.processes import PidRecord
from draftloop.infra.training.fit import fit
from draftloop.infra.training.job import TrainingJob
from draftloop.infra.training.stream import hidden_state_stream

STORE_BYTES = 150 * 1024 * 1024


def main() -> None:
    target, work = Path(sys.argv[1]), Path(sys.argv[2])
    # The head holds the target (and no CPU for trainers); the second node has the CPUs.
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "resources": {"target_host": 1}, "object_store_memory": STORE_BYTES},
    )
    cluster.add_node(num_cpus=2, object_store_memory=STORE_BYTES)
    try:
        ray.init(address=cluster.address)
        conversations = _synthesized(str(work / "synth"), _conversations(SAMPLES, 9))
        config = _config(target, work, producer_resource="target_host")
        pids = PidRecord(work / "pids.json")
        with hidden_state_stream(config, conversations, None, pids) as stream:
            producer_nodes = ray.get([p.node.remote() for p in stream.hidden.producers])
            final = fit(
                config, TrainingJob.from_config(config, stream.hidden, work / "train", {}), "two", pids
            )
        result = json.loads((final / "result.json").read_text())
        nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
        (work / "found.json").write_text(
            json.dumps(
                {
                    "nodes": nodes,
                    "head": cluster.head_node.node_id,
                    "producer_nodes": producer_nodes,
                    "stream": result["stream"],
                    "trained_per_sample": [epoch["trained_per_sample"] for epoch in result["epochs"]],
                    "held_out_samples": result["held_out_samples"],
                }
            )
        )
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
