"""The loop and its writes: claim -> admit -> step -> write; a job's RQ bookkeeping, its fenced
writes and endings, when they go out, embedding jobs, text jobs and request budgets."""
