"""The ingress: OpenAI-compatible HTTP routes, request bodies and errors, and how one request
runs over the engine replicas (colocated, or prefill then decode)."""
