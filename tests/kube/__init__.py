"""Real Kubernetes parts for the tests: the control plane (cluster.py) and a node of our own (kubelet.py)."""
