"""A multi-slot runtime LoRA engine in pure PyTorch. It never imports ComfyUI.

    cache = default_cache()
    a = cache.load("style.safetensors")
    bank = SlotBank.of(model, max_loras=4)
    bank.activate([(a, 0.8)])        # y = f(x) + Σ sᵢ·Bᵢ·Aᵢ·x on every targeted layer
    bank.set_strength(a, 0.5)        # a tensor write
    bank.activate([Entry(a, 0.8, Schedule.parse("0:1, 1:0.2"), {"up.0": 0.0})])
    bank.set_progress(0.5)           # the schedule at this sampling progress: a tensor write
    fuse(model, distilled, 1.0)      # W ← W + s·ΔW in fp32, rounded once, never twice
"""

from .adapter import Adapter, FileIdentity, load_adapter
from .banks import all_banks, occupancies
from .binding import bind
from .cache import AdapterCache, CacheStats, default_cache
from .blocks import BlockWeights
from .errors import (EngineError, FuseError, LoRAError, LoRAFileError, LoRAFormatError, LoRANoMatchError,
                     LoRAShapeError, NonFiniteError, ShapingError, SlotLimitError)
from .fuse import FuseResult, fuse, ledger_of
from .keymap import KeyMap, Target
from .reader import read_header
from .report import MatchReport
from .regions import Gathered, Layout, Region, Tokens
from .request import Entry
from .schedule import Schedule
from .slots import Activation, SlotBank

__all__ = [
    "Activation", "Adapter", "AdapterCache", "BlockWeights", "CacheStats", "EngineError", "Entry", "FileIdentity",
    "FuseError", "FuseResult", "Gathered", "KeyMap", "Layout", "LoRAError", "LoRAFileError", "LoRAFormatError",
    "LoRANoMatchError", "LoRAShapeError", "MatchReport", "NonFiniteError", "Region", "Schedule", "ShapingError",
    "SlotBank", "SlotLimitError", "Target", "Tokens", "all_banks", "bind", "default_cache", "fuse", "ledger_of",
    "load_adapter", "occupancies", "read_header",
]
