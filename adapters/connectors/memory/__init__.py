"""The in-process ``memory`` connector and the pool store it shares with the shm sender."""
