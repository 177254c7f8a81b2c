"""ComfyUI in-process: import its modules and the pack, and build tiny models of its families.

For scripts run with ComfyUI's own python (its venv): `bench/compare.py` and the host tier's
`tests/host/support/family_check.py`. Nothing here is imported by the engine or the nodes, and nothing in
ComfyUI is mocked or changed: its modules are imported from the checkout as `main.py --cpu` would
import them.

    root = find_comfy(None)
    comfy = import_comfy(root, "cpu")
    bridge = import_bridge()      # from the pack, loaded as ComfyUI loads a custom-node folder (import_pack)
    engine = import_engine()      # the engine the bridge uses (not a second copy from `import lora_engine`)
    patcher = build_model(comfy, torch, {"image_model": "wan2.1", "model_type": "t2v", ...},
                          dtype=torch.float32, device=torch.device("cpu"), expect="WAN21_T2V")

A model is built the way ComfyUI builds one from a file: `comfy.model_detection.model_config_from_unet_config`
picks the supported-model class for the unet_config, whose `get_model` builds ComfyUI's own model class
(`comfy.model_base.*` around `comfy.ldm.*`), wrapped in a `ModelPatcher`. Only the weights are synthetic.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class ComfyNotFound(SystemExit):
    """No ComfyUI checkout at the places looked at. A `SystemExit`: a script that does not catch it exits
    with the message, as a command-line tool should."""


class ModelConfigError(RuntimeError):
    """ComfyUI picks no supported-model class, or another one than expected, for a unet_config."""


def find_comfy(arg: str | None) -> Path:
    """The ComfyUI folder: `arg`, else $COMFYUI_PATH, else ~/comfy/ComfyUI, else the repo's .comfy copy
    (comfy/ + folder_paths.py + node_helpers.py, as bench/README.md describes)."""
    cands = [arg, os.environ.get("COMFYUI_PATH"), "~/comfy/ComfyUI", str(ROOT / ".comfy")]
    for c in cands:
        if c and (Path(c).expanduser() / "comfy" / "sd.py").is_file():
            return Path(c).expanduser().resolve()
    raise ComfyNotFound("ComfyUI not found: pass --comfy PATH (a checkout, or the copy made as bench/README.md "
                        f"says), or set COMFYUI_PATH; looked at {[c for c in cands if c]}")


def import_comfy(root: Path, device: str):
    """Import ComfyUI's modules with --cpu semantics (or the classic, non-dynamic loader on a GPU), and ComfyUI's
    default model folders in an empty folder of their own (as `--models-directory` would put them)."""
    if importlib.util.find_spec("torchaudio") is None:
        # ComfyUI 0.28 imports torchaudio on the `import comfy.sd` path; tools/comfy_server.py's stub
        # (import works, any use raises) is put on sys.path, as the server harness does.
        from tools.comfy_server import write_torchaudio_stub
        shim = Path(tempfile.mkdtemp(prefix="multilora-shims-"))
        atexit.register(shutil.rmtree, shim, True)
        write_torchaudio_stub(shim)
        sys.path.insert(0, str(shim))
    sys.path.insert(0, str(root))
    from comfy.cli_args import args
    if "folder_paths" not in sys.modules and not args.models_directory:
        # An empty models folder in place of <checkout>/models, whose files (a user's own LoRAs) no check may
        # see: a check gives `folder_paths` the folders it means ComfyUI to read.
        models = Path(tempfile.mkdtemp(prefix="multilora-models-"))
        atexit.register(shutil.rmtree, models, True)
        args.models_directory = str(models)
    if device == "cpu":
        args.cpu = True
    else:
        # The estimate-based loader: ModelPatcher.patch_model with weight backups (ComfyUI's
        # dynamic-VRAM loader, default on CUDA since 0.2x, patches at op time instead).
        args.disable_dynamic_vram = True
    import comfy.lora  # after args.cpu: comfy.model_management reads it at import, as under main.py
    import comfy.lora_convert
    import comfy.model_detection
    import comfy.model_management
    import comfy.model_patcher
    import comfy.patcher_extension
    import comfy.sample
    import comfy.sd
    import comfy.utils
    import comfy.weight_adapter
    return comfy


class PackLoadError(RuntimeError):
    """ComfyUI's loader did not load the pack (its log line says why), or `nodes` is not ComfyUI's module."""


def import_pack():
    """The pack, loaded as ComfyUI loads a custom-node folder: by ComfyUI's own `nodes.load_custom_node`, as a package
    named after the folder's path. The pack's modules import one another relatively, so its `nodes/` folder and
    ComfyUI's `nodes` module do not meet. Call `import_comfy` first; a second call returns the same package."""
    import nodes as comfy_nodes  # ComfyUI's: import_comfy put its folder first on sys.path
    if not hasattr(comfy_nodes, "load_custom_node"):
        raise PackLoadError(f"`nodes` is {comfy_nodes.__file__}, not ComfyUI's nodes.py: import_comfy goes first")
    name = str(ROOT).replace(".", "_x_")  # the name load_custom_node gives a folder
    if name not in sys.modules and not asyncio.run(comfy_nodes.load_custom_node(str(ROOT))):
        raise PackLoadError(f"ComfyUI's load_custom_node did not load {ROOT} (its log line above says why)")
    return sys.modules[name]


def import_bridge():
    """The pack's bridge package, nodes/bridge/, from the pack `import_pack` loads."""
    return importlib.import_module(f"{import_pack().__name__}.nodes.bridge")


def import_node_module(name: str):
    """One of the pack's node modules (`conditioning`, `stack`, …), from the pack `import_pack` loads."""
    return importlib.import_module(f"{import_pack().__name__}.nodes.{name}")


def import_engine(name: str = ""):
    """The engine package, or its module `name` (`errors`, `slots`, …), as the pack `import_pack` loads it: the one
    the bridge uses. A plain `import lora_engine` is another copy, with its own classes and its own cache."""
    return importlib.import_module(f"{import_pack().__name__}.lora_engine" + (f".{name}" if name else ""))


def entry_of(adapter, strength_model, strength_clip, schedule=None, blocks=None, region=None):
    """One LoRA of a stack as `bridge.apply_stack` takes it: (adapter, the pack's stack entry) with these strengths
    (a list: one model strength per batch item) and this shaping (`lora_engine/stack/shaping.py`)."""
    stack, shaping = import_engine("stack.entry"), import_engine("stack.shaping")
    strength = tuple(strength_model) if isinstance(strength_model, list) else strength_model
    return adapter, stack.Entry(adapter.name, strength, strength_clip, shaping.Shaping(schedule, blocks, region=region))


def build_model(comfy, torch, unet_config: dict, *, dtype, device, expect: str | None = None,
                resize: dict | None = None, seed: int = 0, std: float = 0.02, buffers: tuple[str, ...] = ()):
    """A `ModelPatcher` around ComfyUI's model for `unet_config`, with random weights.

    `expect`: the supported-model class name ComfyUI must pick (else `ModelConfigError`). `resize`:
    unet_config entries replaced after the class is picked, for families whose class is recognised by
    full-size dimensions (SDXL: `model_channels` 320, `transformer_depth` [0, 0, 2, 2, 10, 10]); the
    model and ComfyUI's key maps (`comfy.utils.unet_to_diffusers` reads the config) then both see the
    small ones. Weights: matrices and kernels N(0, std), 1-D weights and scales (norm gains) 1, the rest 0
    (ComfyUI's ops skip initialisation, so every tensor is given a finite value). `buffers`: names (their
    last component) of buffers that ComfyUI allocates empty and fills from the file, as parameters are
    (SD3's `pos_embed`: torch.empty, else garbage, measured 6e37, and a NaN output); they are drawn N(0, std)
    after the parameters. Every other buffer keeps the value the model computed (rope tables, sigmas)."""
    config = comfy.model_detection.model_config_from_unet_config(unet_config)
    if config is None:
        raise ModelConfigError(f"ComfyUI picks no supported model for unet_config {unet_config!r}")
    if expect is not None and type(config).__name__ != expect:
        raise ModelConfigError(f"ComfyUI picks {type(config).__name__} for unet_config {unet_config!r}, "
                               f"expected {expect}")
    config.unet_config.update(resize or {})
    config.set_inference_dtype(dtype, None)
    model = config.get_model({}, "", device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std, generator=g)
            elif name.endswith(("weight", "scale")) or "norm" in name:  # the 1-D ones: norm gains
                p.fill_(1.0)
            else:
                p.zero_()
        for name, b in model.named_buffers():
            if name.rsplit(".", 1)[-1] in buffers:
                b.normal_(0.0, std, generator=g)
    mm = comfy.model_management
    return comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                            offload_device=mm.unet_offload_device())


def flux_config(hidden: int, depth: int, single: int, **extra) -> dict:
    """A Flux-dev unet_config of another size (heads of 128, as Flux-dev); `extra` replaces entries."""
    config = {
        "image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 768,
        "context_in_dim": 4096, "hidden_size": hidden, "mlp_ratio": 4.0, "num_heads": hidden // 128,
        "depth": depth, "depth_single_blocks": single, "axes_dim": [16, 56, 56], "theta": 10000,
        "patch_size": 2, "qkv_bias": True, "guidance_embed": True, "txt_ids_dims": [],
    }
    config.update(extra)
    return config


def build_flux(comfy, torch, hidden: int, depth: int, single: int, dtype, device):
    """ComfyUI's Flux (comfy.model_base.Flux around comfy.ldm.flux.model.Flux) of this size."""
    return build_model(comfy, torch, flux_config(hidden, depth, single), dtype=dtype, device=device,
                       expect="Flux")


def flux_lora_targets(comfy, torch, root) -> list[tuple[str, int, int]]:
    """(kohya prefix, in, out) of every Linear of every block of a Flux `root` (comfy.model_base.Flux), each checked
    against ComfyUI's key map."""
    keymap = comfy.lora.model_lora_keys_unet(root, {})
    out = []
    for name, m in root.named_modules():
        if isinstance(m, torch.nn.Linear) and (".double_blocks." in name or ".single_blocks." in name):
            prefix = "lora_unet_" + name[len("diffusion_model."):].replace(".", "_")
            if keymap.get(prefix) != name + ".weight":
                raise RuntimeError(f"{prefix} is not in comfy.lora.model_lora_keys_unet's map as {name}.weight")
            out.append((prefix, m.in_features, m.out_features))
    return out


def flux_lora_tensors(torch, targets, seed: int, rank: int) -> dict:
    """A kohya LoRA's tensors on `targets` (`flux_lora_targets`): bf16 factors drawn from `seed`, alpha = rank."""
    g = torch.Generator().manual_seed(seed)
    t = {}
    for prefix, fin, fout in targets:
        t[prefix + ".lora_down.weight"] = (torch.randn(rank, fin, generator=g) * 0.02).to(torch.bfloat16)
        t[prefix + ".lora_up.weight"] = (torch.randn(fout, rank, generator=g) * 0.02).to(torch.bfloat16)
        t[prefix + ".alpha"] = torch.tensor(float(rank))
    return t
