"""lora_engine/stack/pairs.py: which file is a Wan 2.2 LoRA's partner, and which names are refused."""

import pytest

from lora_engine.stack import pairs

NAMES = [
    "wan/style_high_noise.safetensors", "wan/style_low_noise.safetensors",
    "Wan2.2-Lightning_T2V-A14B-4steps-lora_HIGH_fp16.safetensors",
    "Wan2.2-Lightning_T2V-A14B-4steps-lora_LOW_fp16.safetensors",
    "motion_HN.safetensors", "motion_LN.safetensors", "wan22HighNoise.safetensors", "wan22LowNoise.safetensors",
    "detail.safetensors", "highlight.safetensors", "lowkey_high-noise.safetensors", "lowkey_low-noise.safetensors",
    "a/split_high.safetensors", "b/split_low.safetensors",
    "twice_high_HN.safetensors", "twice_low_HN.safetensors", "twice_high_LN.safetensors",
    "Case_High_Noise.safetensors", "case_low_noise.safetensors",
]


@pytest.mark.parametrize(("high", "low"), [
    ("wan/style_high_noise.safetensors", "wan/style_low_noise.safetensors"),
    ("Wan2.2-Lightning_T2V-A14B-4steps-lora_HIGH_fp16.safetensors",
     "Wan2.2-Lightning_T2V-A14B-4steps-lora_LOW_fp16.safetensors"),
    ("motion_HN.safetensors", "motion_LN.safetensors"),
    ("wan22HighNoise.safetensors", "wan22LowNoise.safetensors"),
    ("lowkey_high-noise.safetensors", "lowkey_low-noise.safetensors"),
    ("Case_High_Noise.safetensors", "case_low_noise.safetensors"),
])
def test_a_pair_is_found_from_either_file(high, low):
    assert pairs.pair_of(high, NAMES) == pairs.Pair(high, low)
    assert pairs.pair_of(low, NAMES) == pairs.Pair(high, low)
    assert pairs.pair_info(high, NAMES) == {"high": high, "low": low}


@pytest.mark.parametrize("name", ["detail.safetensors", "highlight.safetensors", "not_listed_high.safetensors"])
def test_a_file_without_a_partner_pairs_with_itself(name):
    assert pairs.pair_of(name, NAMES) == pairs.Pair(name, name)
    assert not pairs.pair_of(name, NAMES).paired
    assert pairs.pair_info(name, NAMES) == {}


def test_a_partner_in_another_folder_is_refused_with_the_remedy():
    with pytest.raises(pairs.PairError) as e:
        pairs.pair_of("a/split_high.safetensors", NAMES)
    assert "'b/split_low.safetensors'" in str(e.value) and "same folder" in str(e.value)
    assert "lora_low" in str(e.value)
    assert "error" in pairs.pair_info("b/split_low.safetensors", NAMES)


def test_two_candidates_are_refused_naming_both():
    with pytest.raises(pairs.PairError) as e:
        pairs.pair_of("twice_high_HN.safetensors", NAMES)
    assert "'twice_low_HN.safetensors'" in str(e.value) and "'twice_high_LN.safetensors'" in str(e.value)


def test_a_noise_word_is_tried_before_a_bare_high_or_low():
    names = ["low_res_high_noise.safetensors", "low_res_low_noise.safetensors", "high_res_high_noise.safetensors"]
    assert pairs.pair_of(names[0], names) == pairs.Pair(names[0], names[1])


def test_the_swapped_word_keeps_its_case():
    assert [s[2] for s in pairs.swaps("x_HIGH_y.safetensors")] == ["x_LOW_y.safetensors"]
    assert [s[2] for s in pairs.swaps("x_High_Noise.safetensors")] == ["x_Low_Noise.safetensors"]
    assert [s[2] for s in pairs.swaps("x_ln.safetensors")] == ["x_hn.safetensors"]
    assert pairs.swaps("highway_lowland.safetensors") == []


def test_the_page_has_the_pair_words_of_the_stack_layer():
    """web/pair_names.js is what tools/web_constants.py writes from this module: the page and the server cannot
    disagree on a row's targets or on the low file found by name."""
    from tools import web_constants

    assert web_constants.TARGET.read_text() == web_constants.text(), \
        "web/pair_names.js is stale: run .venv/bin/python tools/web_constants.py"
    assert f'"{pairs.AUTO}"' in web_constants.text() and all(f'"{t}"' in web_constants.text() for t in pairs.TARGETS)
