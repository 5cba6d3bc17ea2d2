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
from collections.abc import Awaitable, Callable

log = logging.getLogger("adaptdl_sched_main")
RESTART_DELAY_S = 1.0


async def restarted(name: str, run: Callable[[], Awaitable[None]]) -> None:
    """``run`` again whenever it fails, as the kubelet restarts a container of upstream's pod:
    its watches end with an exception on any error event (a CRD's storage still starting)."""
    while True:
        try:
            await run()
        except Exception:  # logged, then restarted like a crashed container
            log.exception("%s failed; restarting it in %.0f s", name, RESTART_DELAY_S)
        await asyncio.sleep(RESTART_DELAY_S)


async def main(kubeconfig: str) -> None:
    import kubernetes_asyncio as kubernetes

    await kubernetes.config.load_kube_config(config_file=kubeconfig)
    from adaptdl_sched.allocator import AdaptDLAllocator
    from adaptdl_sched.cluster_expander import ClusterExpander
    from adaptdl_sched.controller import AdaptDLController

    expander = ClusterExpander()
    print("adaptdl scheduler: running", flush=True)
    await asyncio.gather(restarted("controller", lambda: AdaptDLController().run()),
                         restarted("allocator", lambda: AdaptDLAllocator(expander).run()),
                         restarted("cluster expander", expander.run))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    asyncio.run(main(sys.argv[1]))
