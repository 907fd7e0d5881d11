"""Generation engines: token ids in; token ids, sampled log-probs and a finish reason out."""

from pipeline.engines.base import Engine, Generation, SamplingParams

__all__ = ["Engine", "Generation", "SamplingParams"]
