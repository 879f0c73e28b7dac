"""The project side by side with vLLM (scripts/vs_vllm.sh): offline greedy identity and
tokens/s; the vLLM side runs in vLLM's own environment (vllm_offline.py imports nothing of the
project's)."""
