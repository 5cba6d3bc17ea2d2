"""Kubernetes, plain and through its operators (Kubeflow, FrameworkController, AdaptDL)."""
