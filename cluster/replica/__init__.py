"""The engine replica (a Serve deployment wrapping one EngineHost), the per-step message
channel between it and the ingress, the request router that picks one, and direct streaming
(an ingress replica that owns its engine)."""
