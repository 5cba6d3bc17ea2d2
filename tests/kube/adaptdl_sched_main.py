"""AdaptDL's scheduler as one local process: ``python adaptdl_sched_main.py KUBECONFIG``.

Runs with the interpreter of the virtual environment ``scripts/kube_operators.py build``
makes (adaptdl-sched and its pinned kubernetes-asyncio). Upstream runs the controller, the
allocator and the cluster expander as three processes of one pod, each loading the pod's
in-cluster credentials; here the three run together and load the test cluster's kubeconfig.
The supervisor (hints from AdaptDL's training library) and the validating webhook are not
started: trialkeeper's agent does not call the one, and the other only checks updates of
a job's spec, which trialkeeper never makes.
"""

from __future__ import annotations

import asyncio
import logging
import sys


async def main(kubeconfig: str) -> None:
    import kubernetes_asyncio as kubernetes

    await kubernetes.config.load_kube_config(config_file=kubeconfig)
    from adaptdl_sched.allocator import AdaptDLAllocator
    from adaptdl_sched.cluster_expander import ClusterExpander
    from adaptdl_sched.controller import AdaptDLController

    expander = ClusterExpander()
    print("adaptdl scheduler: running", flush=True)
    await asyncio.gather(AdaptDLController().run(), AdaptDLAllocator(expander).run(), expander.run())


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    asyncio.run(main(sys.argv[1]))
