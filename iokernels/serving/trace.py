"""A seeded request trace shaped like ShareGPT, the chat trace PagedAttention is measured on.

The vLLM paper (Kwon et al., SOSP 2023, paper, section 6.1 and Fig. 11) serves requests
whose lengths come from ShareGPT, conversations users shared from ChatGPT: a mean input
of 161.31 tokens and a mean output of 337.99, with long tails; arrivals follow a Poisson
process.  This module draws lengths from log-normal distributions with those means (the
log-normal shape and its spread ``sigma`` are this module's choice, not the paper's: a
heavy right tail like the paper's histograms), scaled down by ``scale`` for small models,
and arrival gaps from an exponential distribution of rate ``rate`` requests per second.
"""
from __future__ import annotations

import numpy as np

from .requests import Request

__all__ = ["SHAREGPT_MEAN_PROMPT", "SHAREGPT_MEAN_OUTPUT", "sharegpt_like_trace", "lognormal_lengths"]

#: ShareGPT's mean prompt and output lengths in tokens (Kwon et al., SOSP 2023, Fig. 11)
SHAREGPT_MEAN_PROMPT = 161.31
SHAREGPT_MEAN_OUTPUT = 337.99


def lognormal_lengths(rng, count, mean, sigma, lo, hi):
    """``count`` integer lengths, log-normal with the given mean before clipping to [lo, hi]."""
    mu = np.log(mean) - sigma ** 2 / 2                       # E[exp(N(mu, sigma^2))] = mean
    return np.clip(np.rint(rng.lognormal(mu, sigma, count)), lo, hi).astype(int)


def sharegpt_like_trace(count, *, seed=0, vocab=256, scale=1.0, max_prompt=1024, max_new_tokens=1024,
                        rate=10.0, sigma=1.0, temperature=0.0):
    """``count`` :class:`Request` s: ShareGPT-like lengths times ``scale``, Poisson arrivals.

    Each request may generate up to ``max_new_tokens`` (what a server that reserves memory
    up front must reserve) and stops after its drawn output length (its end of sequence).
    Prompts are random token ids below ``vocab``.  The same seed gives the same trace.
    """
    rng = np.random.default_rng(seed)
    prompts = lognormal_lengths(rng, count, SHAREGPT_MEAN_PROMPT * scale, sigma, 1, max_prompt)
    outputs = lognormal_lengths(rng, count, SHAREGPT_MEAN_OUTPUT * scale, sigma, 1, max_new_tokens)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, count))
    return [Request(i, rng.integers(0, vocab, int(p)).tolist(), int(max_new_tokens), stop_after=int(o),
                    arrival=float(t), temperature=temperature, seed=seed)
            for i, (p, o, t) in enumerate(zip(prompts, outputs, arrivals))]
