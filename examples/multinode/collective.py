"""One process of a multi-node trial: JAX's multi-process CPU backend joins the nodes at the
rendezvous trialkeeper gives (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK), an all-gather runs
across them over gloo, and rank 0 reports the result."""

import json
import os

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
print(f"rank {rank} of {world} up", flush=True)
jax.distributed.initialize(
    coordinator_address=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
    num_processes=world, process_id=rank, initialization_timeout=120,
)

import jax.numpy as jnp
from jax.experimental import multihost_utils
from trialkeeper.agent import trial

params = trial.get_next_parameter()
# Every node contributes x * (its rank + 1); every node sees the same gathered values.
gathered = multihost_utils.process_allgather(jnp.array([params["x"] * (rank + 1.0)]))
total = float(gathered.sum())
names = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "NODE_RANK", "LOCAL_RANK", "NNODES",
         "TRIALKEEPER_NODE_RANK", "NNI_TRIAL_JOB_ID")
print(json.dumps({"rank": rank, "total": total, "env": {n: os.environ.get(n) for n in names}}), flush=True)
# Only rank 0's result is the trial's; another rank's is ignored (with a note in its log).
trial.report_final_result(total)
jax.distributed.shutdown()
