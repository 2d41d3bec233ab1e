"""Quality measurements of a loaded engine (perplexity, greedy agreement with a reference)."""

from mrv2.eval.agreement import AgreementResult, greedy_agreement
from mrv2.eval.perplexity import PerplexityResult, perplexity

__all__ = ["AgreementResult", "PerplexityResult", "greedy_agreement", "perplexity"]
