"""The process-wide registry of live slot banks, which the status reports read."""

from __future__ import annotations

import threading
import weakref
from typing import Protocol


class Bank(Protocol):
    """A bank as the registry lists it (`slots.SlotBank`)."""

    lock: threading.RLock

    @property
    def holds(self) -> bool: ...

    def occupancy(self) -> dict: ...


_BANKS: weakref.WeakSet[Bank] = weakref.WeakSet()
_BANKS_LOCK = threading.Lock()


def add(bank: Bank) -> None:
    """List `bank` until `discard` or until it is freed (a bank does so as it is made)."""
    with _BANKS_LOCK:
        _BANKS.add(bank)


def discard(bank: Bank) -> None:
    """Take `bank` off the list (a bank does so as it is released)."""
    with _BANKS_LOCK:
        _BANKS.discard(bank)


def all_banks() -> list[Bank]:
    """Every live bank in the process, for status reporting (safe while another thread creates one)."""
    with _BANKS_LOCK:
        banks = list(_BANKS)
    return [b for b in banks if b.holds]


def occupancies() -> list[dict]:
    """Every live bank's `occupancy`, each read under the bank's lock: a bank that another thread released after
    `all_banks` listed it (ComfyUI's prompt worker unloading its model while the server reads the status) is left
    out, not listed halfway through its release."""
    out = []
    for bank in all_banks():
        with bank.lock:
            if bank.holds:
                out.append(bank.occupancy())
    return out
