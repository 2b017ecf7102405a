"""Producer side of llama-fleet: `Fleet` (submit, stream, result, cancel) and the `fleet` CLI.
Importing it never imports llama_cpp."""

from dispatcher.client import Fleet, FleetJob, JobFailed, JobRestarted, JobTimeout

__all__ = ["Fleet", "FleetJob", "JobFailed", "JobRestarted", "JobTimeout"]
