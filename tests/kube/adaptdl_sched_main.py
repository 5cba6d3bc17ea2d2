"""AdaptDL's scheduler as one local process: ``python adaptdl_sched_main.py KUBECONFIG``.

Runs with the interpreter of the virtual environment ``scripts/kube_operators.py build``
makes (adaptdl-sched and its pinned kubernetes-asyncio). Upstream runs the controller and
the allocator as processes of one pod, each loading the pod's in-cluster credentials; here
the two run together and load the test cluster's kubeconfig. Not started: the supervisor
(hints from AdaptDL's training library, which trialkeeper's agent never calls), the
validating webhook (it checks updates of a job's spec, which trialkeeper never makes) and
the cluster expander's loop (placeholder pods that keep an autoscaled node group warm: there
is no autoscaler here; the allocator still tells it which nodes it wants).
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
                         restarted("allocator", lambda: AdaptDLAllocator(expander).run()))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    asyncio.run(main(sys.argv[1]))
