"""OpenAI's Responses API (stateless): request models, field audit, answers, formatter, endpoints."""
