"""The ``shm`` connector: one host, separate processes, zero-copy reads from shared memory."""
