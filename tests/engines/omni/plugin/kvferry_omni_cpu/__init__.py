"""vllm-omni on CPU, for kvferry's tests: a platform plugin pairing vllm-omni's AR worker and
runner with vLLM's CPU worker and runner, a tiny AR model and a diffusion pipeline whose output
is the tiny model's next-token logits over the KV it received (tests/engines/omni/)."""
