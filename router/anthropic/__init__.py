"""Anthropic's Messages API: request models, field audit, answers, formatter, endpoints."""
