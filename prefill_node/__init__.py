"""Prefill node: runs prompts into its page pool and hands the pages to a decode node."""
