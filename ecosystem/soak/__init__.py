"""`fleet soak`: the whole fleet at once, under a seeded mix of what users send and of what goes
wrong, then every invariant checked (docs/reliability.md, "Whole-fleet soak").

Each feature holds alone; the soak is for where they meet (a tenant's job on a worker that dies,
a queued job cancelled while its tenant is at its limit, a batch beside interactive traffic
during a Redis restart). One concern per module:

| module | does |
|---|---|
| plan.py | the run's knobs, the tenants (every limit and weight), the one worker-config.json |
| fleet.py, proxy.py | the processes: Redis with AOF (or Sentinel), workers behind link proxies, gateways |
| kinds.py, client.py, traffic.py | what users send, how a request is sent and recorded, the clients |
| faults.py | the seeded fault schedule and each fault, run to its recovery |
| state.py, jobs.py | reads of the fleet's state and of every job it left |
| checks.py, tenancy.py, verdict.py | the invariants: sampled while running, checked once quiet |
| run.py, report.py | the phases; the live display, the JSON and the readable report |
"""
