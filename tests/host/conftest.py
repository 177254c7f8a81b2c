"""Host tier: tests that drive a real ComfyUI server (CPU) with synthetic models.

Run with any python that has pytest (the server itself runs with ComfyUI's
python):  python3 -m pytest tests/host -m host

Environment:
  COMFYUI_PATH          ComfyUI checkout (default ~/comfy/ComfyUI)
  COMFYUI_PYTHON        python for the server (default <checkout>/.venv/bin/python)
  MULTILORA_HOST_CACHE  cache for synthetic model files (default <tmp>/comfyui-multilora-host-cache)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools import comfy_server as cs
from tools import synth

HOST_DIR = Path(__file__).resolve().parent


def pytest_configure(config):
    config.addinivalue_line("markers", "host: needs a real ComfyUI checkout; starts a ComfyUI server on 127.0.0.1 (CPU)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HOST_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.host)


@pytest.fixture(scope="session")
def comfy_root() -> Path:
    root = cs.find_comfy_root()
    if root is None:
        looked = ", ".join(str(p) for p in cs.comfy_search_locations())
        pytest.skip(f"host tier skipped: no ComfyUI checkout (main.py + comfy/) found; looked at {looked}; "
                    f"set COMFYUI_PATH to enable")
    py = cs.find_comfy_python(root)
    if not (os.path.isfile(py) and os.access(py, os.X_OK)):
        pytest.skip(f"host tier skipped: ComfyUI python {py!r} is not executable (set COMFYUI_PYTHON)")
    return root


@pytest.fixture(scope="session")
def comfy_python(comfy_root) -> str:
    return cs.find_comfy_python(comfy_root)


@pytest.fixture(scope="session")
def run_script(comfy_root, comfy_python):
    """Run one of the host tier's in-process scripts with ComfyUI's python: `run_script(script, out)` passes it
    `--comfy` and `--out`, fails the test with the stderr tail on a timeout, an error or no output, and
    returns the text written to `out`."""
    import subprocess

    def run(script: Path, out: Path, timeout: float = 600.0) -> str:
        try:
            res = subprocess.run([comfy_python, str(script), "--comfy", str(comfy_root), "--out", str(out)],
                                 cwd=HOST_DIR.parents[1], capture_output=True, text=True, timeout=timeout,
                                 check=False)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"{script.name} did not finish within {timeout:.0f}s; stderr tail:\n"
                        f"{(e.stderr or '')[-3000:]}")
        if res.returncode != 0 or not out.is_file():
            pytest.fail(f"{script.name} failed (rc={res.returncode}); stderr tail:\n{res.stderr[-3000:]}")
        return out.read_text()

    return run


@pytest.fixture(scope="session")
def synth_assets(comfy_root, comfy_python) -> dict:
    """Paths of the cached synthetic checkpoint and LoRAs (built on first use)."""
    return synth.ensure_assets_any_python(comfy_root=comfy_root, python=comfy_python)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory, synth_assets) -> Path:
    """A models/ tree (checkpoints, loras, diffusion_models, vae, clip) holding the synthetic files: a link to the
    checkpoint, copies of the LoRAs (`own_copy`).

    File names: synth.CHECKPOINT_NAME in checkpoints/, synth.LORA_NAMES[kind] in loras/.
    """
    root = tmp_path_factory.mktemp("models")
    for sub in cs.MODEL_SUBDIRS:
        (root / sub).mkdir()
    (root / "checkpoints" / synth.CHECKPOINT_NAME).symlink_to(synth_assets["checkpoint"])
    for kind, path in synth_assets["loras"].items():
        # Real files, not symlinks: the pack refuses LoRA names that resolve outside the loras folders.
        own_copy(path, root / "loras" / synth.LORA_NAMES[kind])
    return root


UNET_NAME = "synth_sd15_unet.safetensors"


def unet_of_checkpoint(checkpoint) -> Path:
    """The synthetic checkpoint's UNet alone, with ComfyUI's native key names, in the synthetic files' cache."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    cache = synth.default_cache_dir() / ("unet_of_" + os.path.basename(checkpoint))
    if not cache.exists():
        prefix = "model.diffusion_model."
        with safe_open(str(checkpoint), "pt") as f:
            sd = {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
        tmp = str(cache) + ".partial"
        save_file(sd, tmp)
        os.replace(tmp, cache)
    return cache


@pytest.fixture(scope="module")
def unet_file(models_dir, synth_assets) -> Path:
    """`UNET_NAME` in diffusion_models: a copy of the synthetic checkpoint's UNet (`unet_of_checkpoint`), DistillFuse
    telling a changed file by its status (`own_copy`)."""
    target = models_dir / "diffusion_models" / UNET_NAME
    if not target.exists():
        own_copy(unet_of_checkpoint(synth_assets["checkpoint"]), target)
    return target


def own_copy(src, dst) -> None:
    """Copy `src` to `dst`: a file with an inode of this session's own, for a file that the pack's nodes name. A hard
    link shares the inode, and with it the status-change time (ctime), with every other link: the synthetic files'
    cache, the models folders of other test sessions on this machine, and other names in this one. Each link made
    or removed there (pytest's clean-up of old temporary folders too) sets a new ctime, which the pack reads as the
    file replaced (`bridge.file_state`, the engine cache's file identity): ComfyUI runs the nodes that name it again
    and the engine reads it again, within a test that counts reads or expects a cached result."""
    import shutil
    tmp = f"{dst}.partial"
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def place(src, dst) -> None:
    """Hard-link `src` to `dst` (a copy across file systems): for a file that only stock nodes name (`own_copy`)."""
    import shutil
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


@pytest.fixture(scope="session")
def server(comfy_root, comfy_python, models_dir, tmp_path_factory):
    srv = cs.ComfyServer(comfy_root=comfy_root, python=comfy_python, models_dir=models_dir,
                         workdir=tmp_path_factory.mktemp("comfy"), extra_args=cs.pinned_cache(comfy_root), role="host")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
