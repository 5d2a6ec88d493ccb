"""Prefill/decode disaggregation of one request: how it splits (split.py), the flow over any
two peers (flow.py), those peers as Serve deployments (serve_peers.py) or plain Ray actors
(actor_peers.py), and where a prompt is prefilled (placement.py)."""
