"""PagedLLM engine, models, sampler, HTTP API and CLI."""
