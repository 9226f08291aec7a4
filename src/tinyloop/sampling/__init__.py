"""Sampling parameters: one frozen, validated object that every generation entry point builds."""

from tinyloop.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
