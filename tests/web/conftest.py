"""Web tier: the pack's frontend extension in headless Chromium, against a real ComfyUI server that
serves its own frontend package.

Needs: a ComfyUI checkout ($COMFYUI_PATH, else ~/comfy/ComfyUI) with its python, node, a Chromium
($CHROMIUM_PATH, else `chromium` on PATH), and playwright-core in tests/web/node_modules (installed
with `npm ci` from package-lock.json when missing; playwright never downloads a browser here). Each
missing piece skips the tier with the reason.

Run:  python -m pytest tests/web -m web
Screenshots of the node go to .artifacts/web/.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tools import comfy_server as cs
from tools import synth

from .support import lora_files
from .support.browser import Browser, ensure_playwright_core, find_chromium

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / ".artifacts" / "web"

META_LORA = "synth_meta.safetensors"        # the kohya LoRA with kohya/modelspec metadata
PARTIAL_LORA = "synth_partial.safetensors"  # the kohya LoRA plus a layer no model has


@pytest.fixture(scope="session")
def web_comfy_root() -> Path:
    root = cs.find_comfy_root()
    if root is None:
        looked = ", ".join(str(p) for p in cs.comfy_search_locations())
        pytest.skip(f"web tier skipped: no ComfyUI checkout found (looked at {looked}; set COMFYUI_PATH)")
    py = cs.find_comfy_python(root)
    if not (os.path.isfile(py) and os.access(py, os.X_OK)):
        pytest.skip(f"web tier skipped: ComfyUI python {py!r} is not executable (set COMFYUI_PYTHON)")
    if not cs.python_has_module(py, "comfyui_frontend_package"):
        pytest.skip(f"web tier skipped: {py} has no comfyui_frontend_package (ComfyUI's frontend)")
    return root


@pytest.fixture(scope="session")
def web_models_dir(tmp_path_factory, web_comfy_root) -> Path:
    """The host tier's synthetic checkpoint and LoRAs, plus two LoRAs that only the web tier needs."""
    assets = synth.ensure_assets_any_python(comfy_root=web_comfy_root, python=cs.find_comfy_python(web_comfy_root))
    root = tmp_path_factory.mktemp("web-models")
    for sub in cs.MODEL_SUBDIRS:
        (root / sub).mkdir()
    (root / "checkpoints" / synth.CHECKPOINT_NAME).symlink_to(assets["checkpoint"])
    for kind, path in assets["loras"].items():
        shutil.copyfile(path, root / "loras" / synth.LORA_NAMES[kind])
    kohya = assets["loras"]["kohya"]
    lora_files.rewrite(kohya, root / "loras" / META_LORA, metadata=lora_files.KOHYA_METADATA)
    lora_files.with_unmatched_layer(kohya, root / "loras" / PARTIAL_LORA)
    return root


@pytest.fixture(scope="session")
def web_server(web_comfy_root, web_models_dir, tmp_path_factory):
    # The model stays while the prompts use it, on a busy machine too: the preset tests compare images bit for bit.
    srv = cs.ComfyServer(comfy_root=web_comfy_root, models_dir=web_models_dir,
                         workdir=tmp_path_factory.mktemp("web-comfy"), extra_args=cs.pinned_cache(web_comfy_root),
                         role="web")
    srv.start()
    try:
        error = srv.pack_import_error()
        assert error is None, f"the pack failed to import:\n{error}"
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def browser_tools() -> tuple[str, str]:
    node = shutil.which("node")
    if node is None:
        pytest.skip("web tier skipped: node is not on PATH")
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("web tier skipped: no Chromium found (install Debian's `chromium`, or set CHROMIUM_PATH)")
    reason = ensure_playwright_core()
    if reason:
        pytest.skip(f"web tier skipped: {reason}")
    return node, chromium


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for stale in ARTIFACTS.glob("failed-*.png"):  # from an earlier run
        stale.unlink()
    return ARTIFACTS


@pytest.fixture(scope="session")
def browser(browser_tools, web_server, artifacts):
    node, chromium = browser_tools
    b = Browser(node, chromium, artifacts / "bridge.log")
    try:
        b.start()
        yield b
    finally:
        b.close()


_SCENARIO_PAGE: dict[str, int] = {}  # module -> the browser's generation its first test ran on


@pytest.fixture(autouse=True)
def scenario_page(request):
    """In a module written as one scenario (`random_order(disabled=True)`: each test builds on the page the tests
    before it left), a test that comes after the browser was started again fails at once, naming the call that did
    not answer, rather than meet a blank page."""
    marker = request.node.get_closest_marker("random_order")
    if marker is None or not marker.kwargs.get("disabled") or "browser" not in request.fixturenames:
        yield
        return
    b = request.getfixturevalue("browser")
    first = _SCENARIO_PAGE.setdefault(request.node.module.__name__, b.generation)
    if b.generation != first:
        pytest.fail(f"the page this scenario built was lost: the browser was started again after {b.stopped} did "
                    f"not answer")
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A screenshot of the whole page when a browser test fails, next to the node's screenshots (not of the blank
    page a browser stopped by the failure would start on)."""
    outcome = yield
    report = outcome.get_result()
    b = item.funcargs.get("browser") if hasattr(item, "funcargs") else None
    if report.when == "call" and report.failed and b is not None and b.running():
        try:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            b.call("screenshot", path=str(ARTIFACTS / f"failed-{item.name}.png"), timeout_s=20)
        except Exception:  # noqa: BLE001, S110  (a failed screenshot must not hide the test's own failure)
            pass
