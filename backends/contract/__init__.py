"""The shared contract at the bottom of llama-fleet: what producers, workers, backends and tools
agree on — Redis key names, the stream codec, Redis reconnect/backoff, request and result
schemas, settings loading, `redact_url`, Redis clients from any URL (`connect.py`), and what the
worker and the producers must both know: the gateway's settings section, the observability
record's shape, a batch line's job id and recorded ending. It imports nothing else from the
project, and importing it never imports llama_cpp (docs/ARCHITECTURE.md, "Layers")."""
