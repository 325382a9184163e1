"""Integrations with real trainers and inference engines (`reshard.integrations.vllm`: a vLLM weight-transfer
backend)."""
