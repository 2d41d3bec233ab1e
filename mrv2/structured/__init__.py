"""Structured output: grammars compiled once per spec, a matcher per request, token bitmasks per step."""

from mrv2.structured.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager"]
