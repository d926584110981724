"""``kvferry bench``: kvferry against the machine's limits and a naive baseline."""
