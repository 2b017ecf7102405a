"""The shared contract at the bottom of llama-fleet: what producers, workers, backends and tools
agree on — Redis key names, the stream codec, Redis reconnect/backoff, request and result
schemas, settings loading, `redact_url`, Redis clients from any URL (`connect.py`). It imports
nothing else from the project, and importing it never imports llama_cpp (docs/ARCHITECTURE.md, "Layers")."""
