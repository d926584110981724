"""``kvferry bench --engine vllm``: a decode vLLM instance's time to first token with the
prompt's KV from kvferry, from vLLM's own P/D connectors, computed locally, and already in the
instance (the floor), in one run on one machine."""
