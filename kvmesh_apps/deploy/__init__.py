"""Deployment: the service table (services.py) and what is rendered from it -- Containerfiles
(images.py), the Kubernetes base (k8s.py) -- plus the containers' health probe (probe.py)."""
