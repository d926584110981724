"""``kvferry demo``: a real two-stage pipeline on this machine, verified bit for bit."""
