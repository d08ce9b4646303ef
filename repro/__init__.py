"""Sem-MoE reproduction suite: routing traces -> placements -> exact all-to-all accounting -> figures."""

__version__ = "0.1.0"
