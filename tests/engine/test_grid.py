"""Grid axes: parsing, entry lookup, cell order and chunking."""

from __future__ import annotations

import pytest

from lora_engine.grid import GridError, build, find_entry, parse_values


@pytest.mark.parametrize("text,values", [
    ("0, 0.25, 0.5, 1.0", [0, 0.25, 0.5, 1.0]),
    ("0;0.5 1", [0, 0.5, 1]),
    ("0:1:0.25", [0, 0.25, 0.5, 0.75, 1.0]),
    ("1:0:-0.5", [1, 0.5, 0]),
    ("-1..1/5", [-1, -0.5, 0, 0.5, 1]),
    ("0.7..0.7/1", [0.7]),
])
def test_values(text, values):
    assert parse_values(text) == pytest.approx(values)


@pytest.mark.parametrize("text,message", [
    ("", "no values"),
    ("0, abc", "'abc'"),
    ("0:1", "start:stop:step"),
    ("0:1:0", "never reaches"),
    ("1:0:0.5", "never reaches"),
    ("0..1/0", "count 0"),
    ("0, nan", "finite"),
    ("0, 1000", "-100..100"),
    ("0:100:0.001", "at most"),
])
def test_bad_values_say_what_was_expected(text, message):
    with pytest.raises(GridError, match=message):
        parse_values(text, "x axis")


@pytest.mark.parametrize("text", [
    "0, " + "x" * 5000,                  # one bad value, pasted long
    "0, 1, " + "7" * 5000,               # a number too large to be finite
    "0:1:" + "0," * 2500,                # not start:stop:step, and the whole text is the value shown
])
def test_an_error_shows_a_long_value_cut_with_its_length(text):
    with pytest.raises(GridError) as e:
        parse_values(text, "x axis")
    message = str(e.value)
    assert len(message) < 250, message
    assert "characters)" in message and "…" in message


NAMES = ["styles/ink.safetensors", "detail.safetensors", "ink.safetensors"]


def test_entry_by_name_stem_and_position():
    assert find_entry(NAMES, "detail.safetensors", "x") == 1
    assert find_entry(NAMES, "detail", "x") == 1
    assert find_entry(NAMES, "#3", "x") == 2 and find_entry(NAMES, "1", "x") == 0
    with pytest.raises(GridError, match="names 2 entries"):
        find_entry(NAMES, "ink", "x")
    with pytest.raises(GridError, match="no stack entry named 'nope'"):
        find_entry(NAMES, "nope", "x")
    with pytest.raises(GridError, match="entry '#4' does not exist"):
        find_entry(NAMES, "#4", "x")
    with pytest.raises(GridError, match="does not exist; the stack has 3 entries"):
        find_entry(NAMES, "#" + "9" * 5000, "x")  # more digits than int() reads


@pytest.mark.parametrize("text,message", [
    ("0:1:1e-320", "gives more than 64 values"),  # (b - a) / step is inf
    ("0..1/" + "9" * 5000, "the count in"),  # more digits than int() reads
])
def test_values_past_any_limit_are_grid_errors(text, message):
    with pytest.raises(GridError, match=message):
        parse_values(text, "x_values")


def test_cells_strengths_and_chunks():
    g = build(NAMES, [0.8, 1.0, 0.3], [("x", "#1", "0, 1"), ("y", "detail", "0:1:0.5"), ("z", "", "")])
    assert g.shape == (2, 3, 1) and g.cells == 6
    assert [g.strengths(i) for i in range(6)] == [
        [0, 0.0, 0.3], [1, 0.0, 0.3], [0, 0.5, 0.3], [1, 0.5, 0.3], [0, 1.0, 0.3], [1, 1.0, 0.3]]
    assert g.table(0, 3) == [[0, 1, 0], [0.0, 0.0, 0.5], [0.3, 0.3, 0.3]]
    assert g.chunks(4) == [(0, 4), (4, 6)] and g.chunks(100) == [(0, 6)]


@pytest.mark.parametrize("used,names,shape", [
    ({"z": "0, 1"}, ["z"], (2, 1, 1)),
    ({"x": "0, 1", "z": "0:1:0.5"}, ["x", "z"], (2, 3, 1)),
    ({"y": "0, 1"}, ["y"], (2, 1, 1)),
])
def test_the_axes_in_use_are_laid_out_in_order_and_keep_their_names(used, names, shape):
    axes = [(f"{a} axis", f"#{i + 1}" if a in used else "", used.get(a, "")) for i, a in enumerate("xyz")]
    g = build(NAMES, [1, 1, 1], axes)
    assert g.shape == shape
    assert [a["axis"] for a in g.describe()["axes"]] == names


def test_grid_errors():
    with pytest.raises(GridError, match="already varied"):
        build(NAMES, [1, 1, 1], [("x", "#1", "0"), ("y", "#1", "1")])
    with pytest.raises(GridError, match="no axis"):
        build(NAMES, [1, 1, 1], [("x", "", "")])
    with pytest.raises(GridError, match="no stack entry is named"):
        build(NAMES, [1, 1, 1], [("x", "", "0, 1")])
