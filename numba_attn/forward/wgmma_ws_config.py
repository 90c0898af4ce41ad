"""The warp-specialised Hopper forward's tile configurations (``forward.wgmma_ws``): the validated ``WsConfig``, the
default and the autotuner's candidates, and what a configuration needs (shared memory, registers).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..core import warpgroup as wgmma
from ..core.fp8 import SUM_ROWS
from ..runtime.device import SIMULATOR
from . import common

MIN_COMPUTE_CAPABILITY = (9, 0)
MAX_HEAD_DIM = 128
ROWS = wgmma.ROWS  # query rows per consumer warpgroup
WARPGROUP = wgmma.WARPGROUP_THREADS
DTYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class WsConfig:
    """Tuning knobs of the warp-specialised kernel (validated where made)."""

    block_n: int = 128  # keys per K / V tile (multiple of 16, at most 256: one TMA box, one wgmma N)
    stages: int = 2  # K / V tiles in flight (the ring's depth)
    pingpong: bool = True  # consumers take turns issuing their MMAs (named barriers)
    persistent: bool = False  # one block per SM looping over the query blocks (else one block per query block)
    consumers: int = 2  # consumer warpgroups of 64 query rows each (2 or 3)
    producer_registers: int = 24  # setmaxnreg.dec of the producer warpgroup
    consumer_registers: int = 240  # setmaxnreg.inc of the consumer warpgroups
    # 8-bit only: P's row sums from the P V MMA (rows of ones under each V^T box: core.fp8.mma_row_sums), not from
    # the softmax's additions (wgmma_ws_fp8.launch keeps the softmax's where the lse is asked for)
    fp8_sums: bool = False

    def __post_init__(self):
        common.check_fields(self, block_n=(16, 256, 16), stages=(1, 8, 1), producer_registers=(24, 256, 8),
                            consumer_registers=(24, 256, 8), consumers=(2, 3, 1))
        for name in ("pingpong", "persistent", "fp8_sums"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"WsConfig.{name}: expected a bool, got {getattr(self, name)!r}")
        common.check_register_budgets(self, self.threads, self.producer_registers, self.consumers,
                                      self.consumer_registers)

    def __repr__(self) -> str:
        # (the tuned tables key their timings by repr: the 16-bit configurations' must not change with an 8-bit field)
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if f.name != "fp8_sums" or self.fp8_sums]
        return f"WsConfig({', '.join(shown)})"

    @property
    def block_m(self) -> int:
        return self.consumers * ROWS

    @property
    def threads(self) -> int:
        return (1 + self.consumers) * WARPGROUP


#: 128-key tiles in two stages (160 KB of shared memory at head dim 128), ping-pong on, 24 / 240 registers (the
#: budgets FlashAttention-3 gives two consumer warpgroups)
DEFAULT_CONFIG = WsConfig()
SIMULATOR_CONFIG = WsConfig(block_n=16, stages=2)
#: what ``flash_forward``'s autotuner times per key (those that fit: ``usable``). Deeper rings for head dim 64, whose
#: tiles compute in less time than a TMA copy takes to land, 192-key tiles there (FlashAttention-3's at head dim
#: 64), and three consumer warpgroups (192 rows; with 160 registers each, up to 128-key tiles at head dim 64 --
#: FlashAttention-3's 192 x 128 tiles there -- and 64-key ones at 128) -- fewer blocks, so less fixed cost per row
#: where tiles are few; their persistent form for head dim 64's causal and mid-length rows
_THREE = dict(consumers=3, producer_registers=32, consumer_registers=160)
TUNING_CANDIDATES = (DEFAULT_CONFIG, WsConfig(block_n=64, stages=3), WsConfig(block_n=128, stages=3),
                     WsConfig(block_n=128, stages=4), WsConfig(block_n=176, stages=2), WsConfig(block_n=176, stages=3),
                     WsConfig(pingpong=False), WsConfig(persistent=True), WsConfig(block_n=96, stages=3, **_THREE),
                     WsConfig(block_n=96, stages=3, pingpong=False, **_THREE), WsConfig(block_n=192, stages=2),
                     WsConfig(block_n=192, stages=3), WsConfig(block_n=64, stages=4, **_THREE),
                     WsConfig(block_n=128, stages=2, **_THREE), WsConfig(block_n=128, stages=3, **_THREE),
                     WsConfig(block_n=128, stages=2, persistent=True, **_THREE))


#: dynamic shared memory a block of sm_90 may use
SHARED_LIMIT = 227 * 1024


def usable(config: WsConfig, head_dim_pad: int) -> bool:
    """Whether ``config`` suits a padded head dim of 16-bit inputs: its tiles fit shared memory and its values the
    registers (and it asks for no 8-bit form: ``fp8_sums``)."""
    return (not config.fp8_sums and shared_bytes(config, head_dim_pad) <= SHARED_LIMIT
            and fits_registers(config, head_dim_pad))


def fits_registers(config: WsConfig, head_dim_pad: int, fp8: bool = False) -> bool:
    """Whether a consumer's live values fit its register budget: S (``block_n / 2`` per thread), P (``block_n /
    4``; 8-bit: ``block_n / 8``), O (``head_dim_pad / 2``) and ~32 for the rest (8-bit: ~36). A rough rule from
    ptxas (2026-11-27): no spills at head dim 64 with 160 registers and 128-key tiles (the rule's 160), nor at 128
    with 240 and 192-key tiles (240); 8-bit at head dim 128: 224-key tiles do not spill at 240 (240), 256-key ones
    spill 192 bytes (260); with three consumers at 160, 96-key tiles do not spill (160), 128-key ones 256 bytes
    (180). ``fp8_sums`` is not counted: O's 8 more columns (4 registers) against the softmax's sums it drops; 224-key
    tiles at head dim 128 and 240 spilled 40 bytes in ptxas, against 16 without, and ran faster (the default)."""
    p_words, rest = config.block_n // (8 if fp8 else 4), (36 if fp8 else 32)
    return config.block_n // 2 + p_words + head_dim_pad // 2 + rest <= config.consumer_registers


def for_window(config: WsConfig | None, head_dim_pad: int, window) -> WsConfig | None:
    """The configuration a call with a sliding ``window`` (a checked ``(left, right)``) runs: with the left side
    bounded every block computes only ~``left / block_n`` key tiles, so its fixed cost (launch, Q's copy, the
    epilogue) weighs, and the persistent form of the default -- the next block's Q and K land under this block's
    last tiles and its epilogue -- is taken where it fits (the tuned entries, chosen on dense calls, often do not:
    3 stages of 128-key tiles with staging tiles exceed shared memory at head dim 128). Else ``config`` as it is.
    (Measured against the tuned entry and the default: docs/benchmarks.md, the window table.)"""
    if window is None or window[0] is None:
        return config
    persistent = dataclasses.replace(default_config(), persistent=True)
    return persistent if usable(persistent, head_dim_pad) else config


def default_config() -> WsConfig:
    return SIMULATOR_CONFIG if SIMULATOR else DEFAULT_CONFIG


def padded_head_dim(head_dim: int) -> int:
    return common.padded_head_dim(head_dim, 16)


def _barriers(stages: int) -> int:
    return 2 + 4 * stages  # Q full, Q empty, then K full, K empty, V full, V empty per stage


def vt_atoms(block_n: int) -> int:
    """8-bit: atom columns (128 keys each) of a ``V^T`` tile."""
    return -(-block_n // 128)


def shared_bytes(config: WsConfig, head_dim_pad: int, fp8: bool = False) -> int:
    """Q (128 rows), ``stages`` K and V tiles (8-bit: ``V^T`` tiles, ``head_dim_pad`` rows per 128 keys), the
    output's staging tiles (persistent or 8-bit: as many 16-bit rows as Q has), the mbarriers, and 1 KB to align
    the first tile to 1024 bytes."""
    if fp8:  # rows of 128 bytes, one atom column; the output's 16-bit rows, one or two
        v_rows = (head_dim_pad + (SUM_ROWS if config.fp8_sums else 0)) * vt_atoms(config.block_n)
        tiles = 128 * (config.block_m + config.stages * (config.block_n + v_rows)
                       + wgmma.atom_columns(head_dim_pad) * config.block_m)
    else:
        staging = config.block_m if config.persistent else 0
        rows = config.block_m + staging + 2 * config.stages * config.block_n
        tiles = 128 * wgmma.atom_columns(head_dim_pad) * rows
    return tiles + 8 * _barriers(config.stages) + 1024
