"""Producer side of llama-fleet: `Fleet` (submit, stream, result, cancel), its asyncio twin
`AsyncFleet` (dispatcher.aio) and the `fleet` CLI. Importing it never imports llama_cpp."""

from dispatcher.client import Fleet, FleetJob, JobTimeout
from dispatcher.stream import JobFailed, JobRestarted

__all__ = ["Fleet", "FleetJob", "JobFailed", "JobRestarted", "JobTimeout"]
