"""ParallelConfig: how many devices, which attention mode, and what one token costs on the wire."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields

import numpy as np

from repro.config_values import check_table, integer, option_keys, text, top_keys
from repro.errors import ConfigError, check_known_keys

ATTENTION_MODES = ("dp", "tp")


def check_devices_per_node(devices: int, devices_per_node: int) -> None:
    """Raise unless devices_per_node >= 1 and, when the devices span several nodes, divides them evenly."""
    if devices_per_node < 1:
        raise ConfigError(f"parallel.devices_per_node must be >= 1, got {devices_per_node}.")
    if devices > devices_per_node and devices % devices_per_node:
        raise ConfigError(
            f"parallel.devices_per_node={devices_per_node} does not divide the {devices} devices, so the nodes "
            f"would differ in size; choose a divisor of {devices}."
        )


@dataclass(frozen=True)
class ParallelConfig:
    """Expert-parallel deployment shape.

    devices: EP degree D (one EP rank per device).
    attention: "dp" (a whole request lives on one rank) or "tp" (every TP rank sees all tokens and the
        reduce-scatter after attention may hand each token of each layer to any rank, in equal slices).
    tokens_per_step: tokens in one TP forward step (the batch the reshuffle sees); in DP mode the number of
        requests scheduled together does not matter for exact accounting.
    bytes_per_token: hidden size x dtype bytes: what one token costs per dispatch or combine message.
    devices_per_node: for hierarchical placement and intra/inter-node traffic splits.
    """

    devices: int
    attention: str = "dp"
    tokens_per_step: int = 4096
    bytes_per_token: int = 4096 * 2
    devices_per_node: int = 8

    def __post_init__(self) -> None:
        for name in ("devices", "tokens_per_step", "bytes_per_token", "devices_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # "abc", 2.5 and 4.0 alike
                raise ConfigError(f"parallel.{name} must be an integer, got {value!r}.")
        if self.devices < 1:
            raise ConfigError(f"parallel.devices must be >= 1, got {self.devices}.")
        if self.attention not in ATTENTION_MODES:
            raise ConfigError(
                f"parallel.attention must be one of {ATTENTION_MODES}, got {self.attention!r}."
            )
        if self.tokens_per_step < self.devices:
            raise ConfigError(
                f"parallel.tokens_per_step ({self.tokens_per_step}) must be >= parallel.devices "
                f"({self.devices}) so every TP rank gets a slice."
            )
        if self.bytes_per_token < 1:
            raise ConfigError(f"parallel.bytes_per_token must be >= 1, got {self.bytes_per_token}.")
        check_devices_per_node(self.devices, self.devices_per_node)

    @property
    def num_nodes(self) -> int:
        """Nodes the D devices span (one when D <= devices_per_node)."""
        return -(-self.devices // self.devices_per_node)

    def node_of_device(self) -> np.ndarray:
        """int[D] node of each device: devices_per_node consecutive devices per node."""
        return np.arange(self.devices) // self.devices_per_node

    @classmethod
    def from_config(cls, config: dict) -> ParallelConfig:
        """Build from the `parallel` config group; an unknown key is a ConfigError naming the known ones."""
        check_known_keys("parallel", config, [f.name for f in fields(cls)])
        return cls(**config)

    def check_experts(self, num_experts: int, num_slots: int | None = None) -> None:
        """Raise unless the physical slots split evenly over the devices."""
        slots = num_experts if num_slots is None else num_slots
        if self.devices > num_experts:
            raise ConfigError(
                f"parallel.devices={self.devices} exceeds the model's {num_experts} experts per layer; "
                f"use at most {num_experts} devices."
            )
        if slots % self.devices:
            raise ConfigError(
                f"EP degree parallel.devices={self.devices} does not divide the {slots} expert slots per "
                f"layer; choose a divisor of {slots}."
            )


# the `parallel` config group: ParallelConfig's fields (tests check they agree); cross-field rules are its own
PARALLEL = {
    "devices": integer(1),
    "attention": text(("dp", "tp")),
    "tokens_per_step": integer(1),
    "bytes_per_token": integer(1),
    "devices_per_node": integer(1),
}


def check_parallel(parallel: dict) -> ParallelConfig:
    """The parallel group's config check (repro.config_schema composes it): keys, types, then ParallelConfig's
    own cross-field rules; returns the ParallelConfig."""
    check_table("parallel", parallel, PARALLEL, top_keys(option_keys("parallel")))
    return ParallelConfig.from_config(parallel)
