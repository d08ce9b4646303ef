"""Discrete-event simulation of an expert-parallel MoE serving engine driven by real routing and a real placement.

Entry point: `simulate(config, plan, trace, hardware, shape, rng) -> SimResult` (repro/sim/simulate.py). Parts:
events (heap core), engine (continuous batching, Attention-DP lockstep / Attention-TP), traffic (per-batch copy
counts, the evaluator's rule), costs (all-to-all backends, roofline), hardware (profiles), shapes (model sizes),
metrics (latency, throughput, SLO goodput).
"""

from repro.sim.hardware import Hardware, load_hardware
from repro.sim.shapes import ModelShape, routing_map
from repro.sim.simulate import SimResult, check_sim_config, simulate

__all__ = ["Hardware", "ModelShape", "SimResult", "check_sim_config", "load_hardware", "routing_map", "simulate"]
