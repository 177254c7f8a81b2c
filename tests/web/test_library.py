"""The picker's routes on a real ComfyUI: the library listing (folders, previews, summaries from the header and the
sidecars, cached by file identity; compact, and gzip-compressed for a client that accepts it) and the preview images
(content type, ETag, 304), confined to the loras folders."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import struct
import urllib.error
import urllib.parse
import urllib.request
import zlib
from pathlib import Path

import pytest

from tools import synth

from .support import lora_files
from .conftest import META_LORA, PARTIAL_LORA

pytestmark = pytest.mark.web

TOP = "library_test"
KOHYA_META = {**lora_files.KOHYA_METADATA}


def png(rgb=(200, 40, 40), size=4) -> bytes:
    """A small valid PNG of one colour."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    raw = b"".join(b"\x00" + bytes(rgb) * size for _ in range(size))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


JPEG = bytes.fromhex("ffd8ffe000104a46494600010100000100010000ffd9")  # SOI, JFIF APP0, EOI
WEBP = b"RIFF" + struct.pack("<I", 4) + b"WEBP"


def request(server, path, headers=None):
    """(status, headers, body bytes) of a GET, errors included."""
    req = urllib.request.Request(server.url + path, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def preview(server, name, headers=None, **query):
    return request(server, "/multilora/preview?" + urllib.parse.urlencode({"name": name, **query}), headers)


def listing(server) -> dict:
    return server.get_json("/multilora/library")


def files_of(doc: dict) -> list[dict]:
    """The files of the compact listing (nodes/library.py), each with its name and only the values it has, as
    web/library.js parseListing reads them."""
    assert doc["format"] == 2, doc.keys()
    fields = doc["fields"]
    return [{"name": prefix + row[0], **{k: v for k, v in zip(fields, row[1:]) if v is not None}}
            for prefix, rows in doc["folders"] for row in rows]


def by_name(lib) -> dict:
    return {f["name"]: f for f in files_of(lib)}


@pytest.fixture(scope="module")
def library(web_server, tmp_path_factory):
    """A nested folder of LoRAs beside the web tier's own: previews of each kind, sidecars, a corrupt sidecar,
    and links that leave the loras folders."""
    loras = web_server.models_dir / "loras"
    top = loras / TOP
    kohya = loras / synth.LORA_NAMES["kohya"]
    outside = tmp_path_factory.mktemp("outside")
    files = {}

    def lora(rel, metadata=None):
        path = top / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        lora_files.rewrite(kohya, path, metadata=metadata if metadata is not None else {})
        files[rel] = path
        return path

    a = lora("flux/characters/alice_v2.safetensors", KOHYA_META)
    a.with_name("alice_v2.preview.png").write_bytes(png())
    a.with_name("alice_v2.json").write_text(json.dumps({"activation text": "alice, blue dress",
                                                          "preferred weight": 0.7}))
    b = lora("flux/characters/bob.safetensors")
    b.with_name("bob.preview.jpg").write_bytes(JPEG)
    b.with_name("bob.civitai.info").write_text("{not json")
    c = lora("wan22/lightning/fast.safetensors")
    c.with_name("fast.preview.webp").write_bytes(WEBP)
    c.with_name("fast.metadata.json").write_text(json.dumps({"usage_tips": json.dumps({"strength": 1.25})}))
    d = lora("wan22/plain.safetensors")
    d.with_name("plain.png").write_bytes(png((0, 90, 200)))
    lora("sdxl/nothing.safetensors")
    # Links out of the loras folders: a LoRA, a preview and a sidecar.
    secret = outside / "secret.safetensors"
    lora_files.rewrite(kohya, secret, metadata={"ss_base_model_version": "sdxl_base_v1-0"})
    (top / "sdxl" / "escape.safetensors").symlink_to(secret)
    (outside / "secret.png").write_bytes(png((0, 0, 0)))
    (top / "sdxl" / "nothing.preview.png").symlink_to(outside / "secret.png")
    (outside / "words.json").write_text(json.dumps({"activation text": "leaked"}))
    (top / "wan22" / "plain.json").symlink_to(outside / "words.json")
    try:
        yield {"top": top, "files": files, "outside": outside}
    finally:
        shutil.rmtree(top, ignore_errors=True)


def name(rel: str) -> str:
    return f"{TOP}/{rel}"


def test_the_server_reads_the_library_as_it_starts(web_server, web_models_dir):
    """As it starts, the server reads the summary of every LoRA in its loras folder in a thread (library.warm_up), so
    the picker's first open finds them cached, and its log says how many."""
    found = re.search(r"\[MultiLoRA\] LoRA library: (\d+) summaries read in [\d.]+ s", web_server.log_text())
    assert found, "no line of the library's reading at start in the server's log"
    at_start = {path.name for path in (web_models_dir / "loras").glob("*.safetensors")
                if path.name in set(synth.LORA_NAMES.values()) | {META_LORA, PARTIAL_LORA}}
    assert int(found.group(1)) == len(at_start), (found.group(0), sorted(at_start))


def test_listing_has_every_folder_previews_and_summaries(web_server, library):
    files = by_name(listing(web_server))
    for rel in library["files"]:
        assert name(rel) in files, f"{rel} is not listed"
    alice = files[name("flux/characters/alice_v2.safetensors")]
    assert alice["base_model"] == "SD1.x" and alice["rank"] == synth.STANDARD_LORAS["kohya"]["rank"]
    assert alice["alpha"] == "2.0" and alice["format"] == "LoRA" and alice["weight"] == 0.7
    assert alice["triggers"][:3] == ["alice", "blue dress", "sks dog"], "sidecar words first, then the header's"
    assert alice["preview"].startswith('"') and "sidecar_error" not in alice and "error" not in alice
    assert files[name("wan22/lightning/fast.safetensors")]["weight"] == 1.25
    assert files[name("wan22/plain.safetensors")]["preview"]
    nothing = files[name("sdxl/nothing.safetensors")]
    assert "preview" not in nothing, "a preview linked out of the loras folders is not offered"
    assert nothing["base_model"] == "SD1.x" and "triggers" not in nothing
    assert str(web_server.models_dir) not in json.dumps(files)


def test_the_listing_is_compact_and_names_the_files_as_comfyui_does(web_server, library):
    """Each folder once, a file's row its own name and its values in the order of `fields`, none at the end of a row;
    folder and file give back the exact names that ComfyUI lists for the LoRA fields."""
    doc = listing(web_server)
    assert doc["fields"] == ["base_model", "rank", "alpha", "format", "triggers", "preview", "title", "weight",
                             "sidecar_error", "error"]
    prefixes = [prefix for prefix, _ in doc["folders"]]
    assert len(prefixes) == len(set(prefixes)) and "" in prefixes and f"{TOP}/flux/characters/" in prefixes
    rows = [row for _, rows in doc["folders"] for row in rows]
    assert all("/" not in row[0] and row[-1] is not None and len(row) <= 1 + len(doc["fields"]) for row in rows)
    stock = web_server.object_info("LoraLoader")["LoraLoader"]["input"]["required"]["lora_name"]
    stock = stock[1]["options"] if stock[0] == "COMBO" else stock[0]
    assert sorted(f["name"] for f in files_of(doc)) == sorted(stock)


def test_the_listing_is_gzip_compressed_for_a_client_that_accepts_it(web_server, library):
    code, headers, plain = request(web_server, "/multilora/library")
    assert code == 200 and "Content-Encoding" not in headers, "no Accept-Encoding: the plain JSON"
    code, headers, packed = request(web_server, "/multilora/library", {"Accept-Encoding": "gzip, deflate, br"})
    assert code == 200 and headers["Content-Encoding"] == "gzip" and "Accept-Encoding" in headers["Vary"]
    assert json.loads(gzip.decompress(packed)) == json.loads(plain)
    assert len(packed) < len(plain) / 2
    assert headers["Cache-Control"] == "no-store"


def test_a_corrupt_sidecar_leaves_the_card_and_says_so(web_server, library):
    bob = by_name(listing(web_server))[name("flux/characters/bob.safetensors")]
    assert bob["sidecar_error"].startswith("bob.civitai.info: not valid JSON")
    assert bob["base_model"] == "SD1.x" and bob["format"] == "LoRA" and "error" not in bob


def test_links_out_of_the_loras_folders_are_not_opened(web_server, library):
    files = by_name(listing(web_server))
    escape = files[name("sdxl/escape.safetensors")]
    assert "resolves outside the configured loras folders" in escape["error"]
    assert "base_model" not in escape and "rank" not in escape, "the linked file's header was read"
    plain = files[name("wan22/plain.safetensors")]
    assert "leaked" not in plain.get("triggers", [])
    assert plain["sidecar_error"] == "plain.json: links outside the loras folders, not read"
    assert str(library["outside"]) not in json.dumps(files)


def test_a_second_listing_reads_no_file_and_a_replaced_file_is_read_again(web_server, library):
    listing(web_server)
    again = listing(web_server)
    assert again["reads"] == 0, "an unchanged library is listed from the cache"
    path = library["files"]["sdxl/nothing.safetensors"]
    kohya = web_server.models_dir / "loras" / synth.LORA_NAMES["kohya"]
    added, sidecar = library["top"] / "sdxl" / "added.safetensors", library["top"] / "sdxl" / "nothing.json"
    original = Path(path).read_bytes()
    try:
        lora_files.rewrite(kohya, path, metadata={"ss_base_model_version": "sdxl_base_v1-0"})  # a new inode
        lora_files.rewrite(kohya, added, metadata={})
        after = listing(web_server)
        files = by_name(after)
        assert files[name("sdxl/nothing.safetensors")]["base_model"] == "SDXL"
        assert name("sdxl/added.safetensors") in files
        assert after["reads"] == 2, "only the replaced and the added file are read"
        sidecar.write_text(json.dumps({"preferred weight": 0.4}))
        after = listing(web_server)
        assert after["reads"] == 1 and by_name(after)[name("sdxl/nothing.safetensors")]["weight"] == 0.4
    finally:  # the library as the other tests of the module expect it, whatever order they run in
        added.unlink(missing_ok=True)
        sidecar.unlink(missing_ok=True)
        restored = Path(f"{path}.restore")
        restored.write_bytes(original)
        os.replace(restored, path)


@pytest.mark.parametrize("rel, content_type, body", [
    ("flux/characters/alice_v2.safetensors", "image/png", png()),
    ("flux/characters/bob.safetensors", "image/jpeg", JPEG),
    ("wan22/lightning/fast.safetensors", "image/webp", WEBP),
    ("wan22/plain.safetensors", "image/png", png((0, 90, 200))),
])
def test_preview_content_type_etag_and_304(web_server, library, rel, content_type, body):
    code, headers, got = preview(web_server, name(rel))
    assert code == 200 and got == body
    assert headers["Content-Type"] == content_type
    tag = headers["ETag"]
    assert tag == by_name(listing(web_server))[name(rel)]["preview"], "the listing and the image agree on the ETag"
    assert headers["Cache-Control"] == "no-cache"
    code, headers, got = preview(web_server, name(rel), {"If-None-Match": tag})
    assert code == 304 and got == b"" and headers["ETag"] == tag
    code, headers, _ = preview(web_server, name(rel), v=tag)
    assert code == 200 and "immutable" in headers["Cache-Control"]


def test_a_replaced_preview_gets_a_new_etag(web_server, library):
    rel = "wan22/plain.safetensors"
    _, headers, _ = preview(web_server, name(rel))
    path = library["top"] / "wan22" / "plain.png"
    original = path.read_bytes()
    tmp = path.with_name("plain.tmp")
    try:
        tmp.write_bytes(png((1, 2, 3)))
        os.replace(tmp, path)
        code, new, got = preview(web_server, name(rel), {"If-None-Match": headers["ETag"]})
        assert code == 200 and got == png((1, 2, 3)) and new["ETag"] != headers["ETag"]
    finally:  # the module's other tests, in any order, read the preview the library was made with
        tmp.write_bytes(original)
        os.replace(tmp, path)


def test_missing_preview_is_a_clear_404(web_server, library):
    code, headers, body = preview(web_server, name("sdxl/added_never.safetensors"))
    doc = json.loads(body)
    assert code == 404 and headers["Content-Type"].startswith("application/json")
    assert "no preview image for" in doc["error"] and str(web_server.models_dir) not in doc["error"]


@pytest.mark.parametrize("bad, says", [
    ("..", "'..' is refused"),
    (f"{TOP}/../../checkpoints/x.safetensors", "'..' is refused"),
    ("../" + synth.LORA_NAMES["kohya"], "'..' is refused"),
    ("/etc/passwd", "absolute paths are refused"),
    ("/etc/hostname.safetensors", "absolute paths are refused"),
    ("a\x00b.safetensors", "NUL byte"),
    ("", "expected a file name"),
    (f"{TOP}/sdxl/nothing.safetensors", "resolves outside the configured loras folders"),  # a symlinked preview
])
def test_preview_refuses_names_outside_the_loras_folders(web_server, library, bad, says):
    code, _, body = preview(web_server, bad)
    doc = json.loads(body)
    assert code == 400 and says in doc["error"], doc
    assert str(web_server.models_dir) not in doc["error"] and str(library["outside"]) not in doc["error"]
    assert web_server.get_json("/multilora/status")["cache"] is not None, "the server answers after the refusal"
