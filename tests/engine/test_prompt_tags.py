"""lora_engine/stack/prompt_tags.py: the `<lora:…>` syntax, the text left, and A1111's name resolution."""

from __future__ import annotations

import pytest

from lora_engine.stack import prompt_tags as tags


@pytest.mark.parametrize(("text", "want"), [
    ("<lora:a>", ("a", 1.0, 1.0)),
    ("<lora:a:0.5>", ("a", 0.5, 0.5)),
    ("<lora:a:-0.4:1.25>", ("a", -0.4, 1.25)),
    ("<LyCO:sub/a:.5>", ("sub/a", 0.5, 0.5)),
    ("<lora:a:te=0.2:unet=0.7>", ("a", 0.7, 0.2)),
    ("<lora:a:0.3:te=0>", ("a", 0.3, 0.0)),
    ("<lora:1:1 style:0.3>", ("1:1 style", 0.3, 0.3)),
    ("<lora:a.safetensors:1e-1>", ("a.safetensors", 0.1, 0.1)),
])
def test_tag_syntax(text, want):
    (tag,) = tags.find_tags(text)
    assert (tag.name, tag.strength_model, tag.strength_clip) == want and tag.text == text


@pytest.mark.parametrize(("text", "message"), [
    ("<lora::0.5>", "names no LoRA"),
    ("<lora:a:0.1:0.2:0.3>", "too many strengths"),
    ("<lora:a:te=x>", "'x' is not a strength"),
])
def test_bad_tags_name_the_tag(text, message):
    with pytest.raises(tags.TagError, match=message) as e:
        tags.find_tags(text)
    assert text in str(e.value)


def test_text_without_tags():
    text = "a photo, <lora:x:0.5>, of a cat  <lora:y> ,  red\n<lora:z:1>\n\n\n\nlast line <lyco:w>"
    assert tags.strip_tags(text) == "a photo, of a cat, red\n\nlast line"
    assert tags.strip_tags("no tags,  here") == "no tags, here"
    assert tags.strip_tags("masterpiece,\n<lora:a>, best quality, <lora:b:0.5>\nred,") == \
        "masterpiece,\nbest quality,\nred,"  # the prompt's own line-end commas stay
    assert tags.TAG.search(tags.strip_tags(text)) is None


FILES = ["style.safetensors", "chars/hero.safetensors", "a/twin.safetensors", "b/twin.safetensors", "old.pt",
         "b/twin.pt.safetensors"]


@pytest.mark.parametrize(("name", "want"), [
    ("style", "style.safetensors"), ("style.safetensors", "style.safetensors"), ("hero", "chars/hero.safetensors"),
    ("chars/hero", "chars/hero.safetensors"), ("a/twin", "a/twin.safetensors"), ("old", "old.pt"),
    ("b\\twin.safetensors", "b/twin.safetensors"), ("twin.pt", "b/twin.pt.safetensors"),
])
def test_names_resolve_by_path_or_file_name_with_or_without_extension(name, want):
    assert tags.resolve_name(name, FILES) == want


def test_a_file_name_two_files_carry_lists_both():
    with pytest.raises(tags.TagError, match="matches 2 files: a/twin.safetensors, b/twin.safetensors"):
        tags.resolve_name("twin", FILES, "<lora:twin:1>")


def test_an_unknown_name_lists_the_closest():
    with pytest.raises(tags.TagError, match=r"no LoRA named 'styel'.*closest names: style.safetensors"):
        tags.resolve_name("styel", FILES)
    with pytest.raises(tags.TagError, match="no similar name"):
        tags.resolve_name("qqqqqqqqqq", FILES)
