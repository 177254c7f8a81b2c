"""The match report: what binding an adapter to a model found, as one line for the log and a dict for the UI."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MatchReport:
    """What binding an adapter to a model found: the layers matched and the path each takes, and what was left."""

    adapter: str
    path: str
    model: str
    matched: int
    low_rank: int
    dense: int
    unmatched: tuple[str, ...]
    leftover: tuple[str, ...]
    formats: tuple[str, ...]
    # Of `unmatched`, the prefixes whose layer the model has but the runtime path does not hook: (prefix, class).
    unhookable: tuple[tuple[str, str], ...] = ()
    # A layer whose A was widened with zero columns: (layer, the file's inputs, the layer's inputs).
    widened: tuple[tuple[str, int, int], ...] = ()
    kron: int = 0  # layers that apply a LoKr as its two factors (`ModulePlan.kron`); not counted in `dense`

    @property
    def partial(self) -> bool:
        return bool(self.unmatched or self.leftover)

    @property
    def runtime_path(self) -> str:
        return runtime_path(self.low_rank, self.kron, self.dense)

    def line(self) -> str:
        kron = f", {self.kron} kronecker" if self.kron else ""
        s = (f"{self.adapter}: {self.matched} layers matched on {self.model} ({'+'.join(self.formats)}, path "
             f"{self.runtime_path}: {self.low_rank} low-rank{kron}, {self.dense} dense)")
        if self.unmatched:
            s += f"; {len(self.unmatched)} unmatched, e.g. {', '.join(self.unmatched[:3])}"
        if self.unhookable:
            s += f" ({unhookable_note(self.unhookable)})"
        if self.widened:
            s += f"; {widened_note(self.widened)}"
        if self.leftover:
            s += f"; {len(self.leftover)} unparsed keys, e.g. {', '.join(self.leftover[:3])}"
        return s

    def as_dict(self) -> dict:
        return {"adapter": self.adapter, "path": self.path, "model": self.model, "matched": self.matched,
                "low_rank": self.low_rank, "kron": self.kron, "dense": self.dense, "unmatched": list(self.unmatched),
                "leftover": list(self.leftover), "formats": list(self.formats), "partial": self.partial,
                "runtime_path": self.runtime_path, "unhookable": [list(u) for u in self.unhookable],
                "widened": [list(w) for w in self.widened]}


def runtime_path(low_rank: int, kron: int, dense: int) -> str:
    """What a report calls the path of layers counted so: low-rank, kronecker or dense where every layer takes that
    path, mixed where they differ."""
    paths = [name for name, n in (("low-rank", low_rank), ("kronecker", kron), ("dense", dense)) if n]
    return paths[0] if len(paths) == 1 else "mixed" if paths else "low-rank"


def kinds(unhookable) -> str:
    """The classes of the unhooked layers `unhookable` names, (prefix, class) pairs, as a report lists them."""
    return ", ".join(sorted({kind for _, kind in unhookable}))


def unhookable_note(unhookable) -> str:
    """What a report says of the keys on layers the runtime path does not hook."""
    return (f"{len(unhookable)} of them on layers the runtime path does not hook ({kinds(unhookable)}); "
            "ComfyUI's LoraLoader fuses those into the weights")


def widened_note(widened) -> str:
    """What a report says of the layers whose A was widened (`MatchReport.widened`)."""
    return "; ".join(f"{name} takes {have} inputs where the file has {got}: the LoRA acts on the first {got} "
                     "(the latent), not on the model's extra input channels" for name, got, have in widened)
