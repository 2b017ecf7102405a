"""Seeing the fleet: status snapshots, job history, Prometheus metrics and the web dashboard.

Workers write the facts (worker/facts.py); everything here only reads Redis."""
