"""OpenAI's Chat Completions and Completions APIs: request models, field audit, answers, formatter, endpoints."""
