"""The project's fairness policies inside other serving engines: vLLM's scheduler
(`pdtb.integrations.vllm.FairScheduler`, docs/vllm.md). Nothing here is imported by `pdtb`."""
