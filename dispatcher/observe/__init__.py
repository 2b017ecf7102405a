"""Seeing the fleet: status snapshots, job history, Prometheus metrics and the web dashboard.

Workers write the facts (worker/hooks/facts.py) in the shape of backends/contract/observe_schema.py;
everything here only reads Redis."""
