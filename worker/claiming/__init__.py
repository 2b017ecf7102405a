"""Which jobs this worker takes: the atomic claim (over the queue model's scripts,
backends/contract/queue), which priorities may take its free slots, and who gives way when
tenants share it."""
