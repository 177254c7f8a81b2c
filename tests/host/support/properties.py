"""Properties that the host tier's in-process checks report: each one whether it holds, with the values it saw.

A check script returns {property: {"ok": bool, value: ...}}; its test runs the script once per module and
parametrises over the properties, so that each failing property is a failure of its own that shows its values.
Imported by the check scripts too (with ComfyUI's python), so nothing here needs pytest.
"""

from __future__ import annotations


def prop(ok: bool, **values) -> dict:
    """One property of a check: whether it holds, and the values it was decided on (JSON-serialisable)."""
    return {"ok": bool(ok), **values}


def assert_holds(result: dict, name: str) -> None:
    """Fails naming the property and its values where the check did not report it or it does not hold."""
    assert name in result, f"the check reported no property {name!r}; it reported {sorted(result)}"
    values = dict(result[name])
    ok = values.pop("ok")
    details = ", ".join(f"{k}={v!r}" for k, v in values.items())
    assert ok is True, f"{name} does not hold: {details}"
