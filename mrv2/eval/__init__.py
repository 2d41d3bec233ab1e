"""Quality measurements of a loaded engine (perplexity)."""

from mrv2.eval.perplexity import PerplexityResult, perplexity

__all__ = ["PerplexityResult", "perplexity"]
