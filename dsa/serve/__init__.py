"""Serving: :class:`.LLM` (text in, text out), tokenizers and chat templates, the engine loop and
the OpenAI-compatible HTTP app."""
from dsa.serve.llm import LLM, Completion

__all__ = ["Completion", "LLM"]
