"""Sampling: per-step metadata, seeded Gumbel-max draws, and the top-k/top-p/min-p sampler."""

from mrv2.sample.gumbel import gumbel_noise, gumbel_sample
from mrv2.sample.metadata import SamplingMetadata
from mrv2.sampling_params import GREEDY_EPS
from mrv2.sample.sampler import Sampler, apply_min_p, apply_top_k_top_p

__all__ = [
    "GREEDY_EPS",
    "Sampler",
    "SamplingMetadata",
    "apply_min_p",
    "apply_top_k_top_p",
    "gumbel_noise",
    "gumbel_sample",
]
