"""Synthetic SD1.5-shaped checkpoint and LoRA files for host-tier tests.

Needs only torch + safetensors at generation time (the ComfyUI venv python or
any python that has both).  No network, no downloaded weights.

Key names and shapes are not hard-coded: they are read ONCE from ComfyUI's own
classes (SD15 model config -> BaseModel/UNetModel, SD1ClipModel, AutoencoderKL,
all built on the meta device) by a short script run with ComfyUI's python, and
cached as a JSON "shape manifest".  The same script records ComfyUI's own
diffusers<->ldm UNet name table (comfy.utils.unet_to_diffusers) so the LoRA
files use the names stock ComfyUI maps for SD1.5.

Checkpoint layout (what CheckpointLoaderSimple detects as SD1.5):
  model.diffusion_model.*                      UNet
  cond_stage_model.transformer.text_model.*    CLIP-L
  first_stage_model.*                          VAE (ldm AutoencoderKL names)
Weights: normal * 0.02 in fp16; norm weights 1, norm biases 0.

LoRA kinds (make_lora):
  kohya  lora_unet_<diffusers_name_with_underscores>.{lora_down,lora_up}.weight + .alpha
         lora_te_text_model_encoder_layers_<i>_<self_attn_q_proj|...>.{...}
  peft   unet.<diffusers name>.{lora_A,lora_B}.weight, no alpha (scale 1).
         Attention projections use the only diffusers spelling stock
         ComfyUI 0.28 maps for SD1.5: "...attn1.processor.to_q" and
         "...attn1.processor.to_out" (plain "...attn1.to_q" is NOT in
         comfy.lora.model_lora_keys_unet's map).  Other layers use the plain
         diffusers name ("unet.down_blocks.0.attentions.0.transformer_blocks.0.ff.net.2").
         text_encoder.text_model.encoder.layers.<i>.self_attn.q_proj.{lora_A,lora_B}.weight
  locon  kohya naming, also on conv layers (lora_down [r, in, kh, kw], lora_up [out, r, 1, 1]).

Files are cached by their content parameters in a cache directory
($MULTILORA_HOST_CACHE, else <tmp>/comfyui-multilora-host-cache), so test
sessions reuse them.

CLI (any python with torch + safetensors):
  python synth.py assets [--cache DIR]        build/reuse the standard test set, print JSON
  python synth.py checkpoint OUT [--seed N]
  python synth.py lora OUT --kind kohya|peft|locon [--seed N] [--rank R] [--no-clip]
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

try:
    from . import comfy_server as _cs
except ImportError:  # run as a script
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import comfy_server as _cs  # type: ignore

GENERATOR_VERSION = 1
BASE_STD = 0.02
CHECKPOINT_NAME = "synth_sd15.safetensors"
LORA_NAMES = {
    "kohya": "synth_kohya.safetensors",
    "peft": "synth_peft.safetensors",
    "locon": "synth_locon.safetensors",
}
# The standard set used by the host tests: kind -> make_lora kwargs.
STANDARD_LORAS = {
    "kohya": dict(kind="kohya", seed=101, rank=4),
    "peft": dict(kind="peft", seed=202, rank=8),
    # conv LoRA on the 320/640-channel resnets only: patching every SD1.5 conv
    # costs ~10 s of CPU per prompt for no extra test value.
    "locon": dict(kind="locon", seed=303, rank=4,
                  targets=("attn", r"re:^(down_blocks\.[01]|up_blocks\.[23])\.resnets\.\d+\.conv[12]$")),
}
STANDARD_CHECKPOINT_SEED = 1234

DEFAULT_TARGETS = {
    "kohya": ("attn",),
    "peft": ("attn", "ff"),
    "locon": ("attn", "conv"),
}
CLIP_GROUPS = ("attn", "mlp")
# Relative size of a LoRA delta: element std of (up @ down * alpha/rank)
# as a fraction of the base weights' std (BASE_STD).
DEFAULT_LORA_SCALE = 1.0


def default_cache_dir() -> Path:
    env = os.environ.get("MULTILORA_HOST_CACHE")
    return Path(env) if env else Path(tempfile.gettempdir()) / "comfyui-multilora-host-cache"


# --------------------------------------------------------------------------
# shape manifest (read from ComfyUI's classes, run with ComfyUI's python)

_MANIFEST_SCRIPT = r'''
import json, os, re, sys
comfy_root, out_path = sys.argv[1], sys.argv[2]
sys.path.insert(0, comfy_root)
os.chdir(comfy_root)
from comfy.cli_args import args
args.cpu = True
import torch
import comfy.model_detection, comfy.sd1_clip, comfy.utils, comfy.supported_models
from comfy.ldm.models.autoencoder import AutoencoderKL

# SD1.5 UNet config as comfy.model_detection.detect_unet_config reports it.
unet_config = {"use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
               "legacy": False, "adm_in_channels": None, "in_channels": 4, "model_channels": 320,
               "num_res_blocks": [2, 2, 2, 2], "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0],
               "channel_mult": [1, 2, 4, 4], "transformer_depth_middle": 1, "use_linear_in_transformer": False,
               "context_dim": 768, "num_heads": 8, "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
               "use_temporal_attention": False, "use_temporal_resblock": False}
model_config = comfy.model_detection.model_config_from_unet_config(unet_config)
assert isinstance(model_config, comfy.supported_models.SD15), type(model_config)
vae_ddconfig = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
with torch.device("meta"):
    unet_model = model_config.get_model({}, "")
    clip = comfy.sd1_clip.SD1ClipModel(device="meta", dtype=torch.float16)
    vae = AutoencoderKL(ddconfig=vae_ddconfig, embed_dim=4)

def roles(module):
    r = {}
    for name, m in module.named_modules():
        is_norm = isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm))
        for pname, _ in m.named_parameters(recurse=False):
            full = (name + "." if name else "") + pname
            if is_norm:
                r[full] = "norm_w" if pname == "weight" else "norm_b"
            elif isinstance(m, torch.nn.Embedding):
                r[full] = "pos_embed" if "position" in name else "embed"
            else:
                r[full] = "bias" if pname == "bias" else "w"
    return r

checkpoint = []
r = roles(unet_model)
for k, v in unet_model.state_dict().items():
    if k.startswith("diffusion_model."):
        checkpoint.append(["model." + k, list(v.shape), r.get(k, "w")])
r = roles(clip)
for k, v in clip.state_dict().items():
    if not k.startswith("clip_l.transformer.text_model."):
        continue  # logit_scale / text_projection are not in SD1.5 checkpoints
    checkpoint.append(["cond_stage_model." + k[len("clip_l."):], list(v.shape), r.get(k, "w")])
r = roles(vae)
for k, v in vae.state_dict().items():
    checkpoint.append(["first_stage_model." + k, list(v.shape), r.get(k, "w")])

usd = unet_model.state_dict()
unet_targets = []
for dk, lk in comfy.utils.unet_to_diffusers(model_config.unet_config).items():
    if not dk.endswith(".weight"):
        continue
    full = "diffusion_model." + lk
    if full not in usd:
        continue  # the table lists e.g. conv_shortcut for every resnet
    shape = list(usd[full].shape)
    if len(shape) not in (2, 4):
        continue
    name = dk[:-len(".weight")]
    if re.search(r"\.attn[12]\.(to_q|to_k|to_v|to_out\.0)$", name):
        group = "attn"
    elif ".ff.net." in name:
        group = "ff"
    elif name.endswith(".proj_in") or name.endswith(".proj_out"):
        group = "proj"
    elif len(shape) == 4:
        group = "conv"
    else:
        group = "other"
    unet_targets.append([name, full, shape, group])

clip_targets = []
pat = re.compile(r"^clip_l\.transformer\.(text_model\.encoder\.layers\.\d+\.(self_attn\.(q|k|v|out)_proj|mlp\.fc[12]))\.weight$")
for k, v in clip.state_dict().items():
    m = pat.match(k)
    if m:
        clip_targets.append([m.group(1), k, list(v.shape), "attn" if "self_attn" in k else "mlp"])

try:
    import comfyui_version
    version = comfyui_version.__version__
except Exception:
    version = "unknown"
with open(out_path, "w") as f:
    json.dump({"format": 1, "comfy_version": version, "checkpoint": checkpoint,
               "unet_targets": unet_targets, "clip_targets": clip_targets}, f)
'''


def _manifest_id(comfy_root: Path) -> str:
    h = hashlib.sha1()
    h.update(str(comfy_root).encode())
    for rel in ("comfyui_version.py", "comfy/supported_models.py", "comfy/model_detection.py",
                "comfy/utils.py", "comfy/sd1_clip.py", "comfy/sd1_clip_config.json"):
        p = comfy_root / rel
        if p.exists():
            h.update(p.read_bytes())
    h.update(_MANIFEST_SCRIPT.encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path):
    """Exclusive lock so parallel sessions don't generate the same file twice."""
    path.parent.mkdir(parents=True, exist_ok=True)
    import fcntl

    with open(str(path) + ".lock", "w") as lf:
        fcntl.flock(lf, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lf, fcntl.LOCK_UN)


def shape_manifest(cache_dir: Path | None = None, comfy_root: Path | None = None,
                   python: str | None = None, timeout: float = 300.0) -> dict:
    """Return the SD1.5 shape manifest, creating it with ComfyUI's python once."""
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    comfy_root = Path(comfy_root) if comfy_root else _cs.find_comfy_root()
    if comfy_root is None:
        raise FileNotFoundError("ComfyUI not found; looked at: "
                                + ", ".join(map(str, _cs.comfy_search_locations())))
    comfy_root = comfy_root.resolve()
    path = cache_dir / f"sd15_manifest_{_manifest_id(comfy_root)}.json"
    if not path.exists():
        with _locked(path):
            if not path.exists():
                python = python or _cs.find_comfy_python(comfy_root)
                tmp = path.with_suffix(".json.tmp")
                with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as sf:
                    sf.write(_MANIFEST_SCRIPT)
                try:
                    res = subprocess.run([python, sf.name, str(comfy_root), str(tmp)], cwd=str(comfy_root),
                                         capture_output=True, text=True, timeout=timeout)
                finally:
                    os.unlink(sf.name)
                if res.returncode != 0:
                    raise RuntimeError(f"shape manifest script failed (rc={res.returncode}):\n{res.stderr[-4000:]}")
                os.replace(tmp, path)
    with open(path) as f:
        m = json.load(f)
    m["_id"] = path.stem.split("_")[-1]
    return m


# --------------------------------------------------------------------------
# generation


def _torch():
    import torch
    from safetensors.torch import save_file

    return torch, save_file


def _gen(seed: int, name: str):
    torch, _ = _torch()
    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def _atomic_save(tensors: dict, path: Path, metadata: dict) -> None:
    _, save_file = _torch()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata={k: str(v) for k, v in metadata.items()})
    os.replace(tmp, path)


def make_checkpoint(path, seed: int = STANDARD_CHECKPOINT_SEED, manifest: dict | None = None, **manifest_kw) -> Path:
    """Write a synthetic SD1.5 checkpoint (fp16, ~2 GB) to ``path``."""
    torch, _ = _torch()
    manifest = manifest or shape_manifest(**manifest_kw)
    tensors = {}
    for key, shape, role in manifest["checkpoint"]:
        if role == "norm_w":
            t = torch.ones(shape, dtype=torch.float16)
        elif role == "norm_b":
            t = torch.zeros(shape, dtype=torch.float16)
        else:
            std = BASE_STD / 2 if role in ("bias", "pos_embed") else BASE_STD
            t = torch.randn(shape, generator=_gen(seed, key), dtype=torch.float32).mul_(std).to(torch.float16)
        tensors[key] = t
    _atomic_save(tensors, Path(path), {"synthetic": "sd15", "seed": seed, "generator": GENERATOR_VERSION,
                                      "manifest": manifest.get("_id", "")})
    return Path(path)


def _peft_unet_name(diffusers_name: str) -> str:
    # Stock 0.28 maps SD1.5 attention projections only under the old
    # attention-processor spelling (comfy/lora.py model_lora_keys_unet).
    if re.search(r"\.attn[12]\.to_(q|k|v|out\.0)$", diffusers_name):
        name = diffusers_name.replace(".to_", ".processor.to_")
        if name.endswith(".to_out.0"):
            name = name[:-2]
        return "unet." + name
    return "unet." + diffusers_name


def lora_key_prefixes(kind: str, manifest: dict, targets=None, include_clip: bool = True) -> dict:
    """{lora module prefix (without .lora_* suffix): (comfy weight key, shape)} for a LoRA layout."""
    if kind not in DEFAULT_TARGETS:
        raise ValueError(f"unknown LoRA kind {kind!r}; expected one of {sorted(DEFAULT_TARGETS)}")
    specs = DEFAULT_TARGETS[kind] if targets is None else ([targets] if isinstance(targets, str) else targets)
    groups = {t for t in specs if not t.startswith("re:")}
    patterns = [re.compile(t[3:]) for t in specs if t.startswith("re:")]
    out = {}
    for name, unet_key, shape, group in manifest["unet_targets"]:
        if group not in groups and not any(p.search(name) for p in patterns):
            continue
        if kind != "locon" and len(shape) == 4 and group == "conv":
            continue
        if kind in ("kohya", "locon"):
            prefix = "lora_unet_" + name.replace(".", "_")
        else:
            prefix = _peft_unet_name(name)
        out[prefix] = ("model." + unet_key, shape)
    if include_clip:
        for name, clip_key, shape, group in manifest["clip_targets"]:
            if group not in CLIP_GROUPS:
                continue
            if kind in ("kohya", "locon"):
                prefix = "lora_te_" + name.replace(".", "_")
            else:
                prefix = "text_encoder." + name
            out[prefix] = (clip_key, shape)
    return out


def make_lora(path, kind: str, seed: int, rank: int = 4, targets=None, include_clip: bool = True,
              scale: float = DEFAULT_LORA_SCALE, manifest: dict | None = None, **manifest_kw) -> Path:
    """Write a synthetic LoRA for the synthetic SD1.5 checkpoint.

    kind: "kohya" | "peft" | "locon".  targets: UNet layer groups from
    {"attn", "ff", "proj", "conv", "other"} and/or "re:<regex>" matched
    against the diffusers layer name (e.g. "down_blocks.0.resnets.1.conv2");
    default per kind, see DEFAULT_TARGETS; 4-D (conv) layers only for locon.  include_clip adds CLIP-L
    attention + MLP layers.  ``scale``: element std of the merged delta
    (up @ down * alpha / rank) relative to the base weights' std.
    """
    torch, _ = _torch()
    manifest = manifest or shape_manifest(**manifest_kw)
    prefixes = lora_key_prefixes(kind, manifest, targets, include_clip)
    if not prefixes:
        raise ValueError("no layers selected")
    target_std = BASE_STD * float(scale)
    alpha = rank / 2.0 if kind in ("kohya", "locon") else None
    alpha_factor = (alpha / rank) if alpha is not None else 1.0
    # element std of up @ down = sqrt(rank) * s_down * s_up
    s = (target_std / (rank ** 0.5 * alpha_factor)) ** 0.5
    tensors = {}
    for prefix in sorted(prefixes):
        _key, shape = prefixes[prefix]
        out_f, in_f = shape[0], shape[1]
        if len(shape) == 4:
            down_shape, up_shape = [rank, in_f, shape[2], shape[3]], [out_f, rank, 1, 1]
            s_down = s / (shape[2] * shape[3]) ** 0.5  # flatten(1) of the kernel has kh*kw more terms
        else:
            down_shape, up_shape = [rank, in_f], [out_f, rank]
            s_down = s
        g = _gen(seed, prefix)
        down = torch.randn(down_shape, generator=g).mul_(s_down).to(torch.float16)
        up = torch.randn(up_shape, generator=g).mul_(s).to(torch.float16)
        if kind == "peft":
            tensors[prefix + ".lora_A.weight"] = down
            tensors[prefix + ".lora_B.weight"] = up
        else:
            tensors[prefix + ".lora_down.weight"] = down
            tensors[prefix + ".lora_up.weight"] = up
            tensors[prefix + ".alpha"] = torch.tensor(alpha, dtype=torch.float16)
    _atomic_save(tensors, Path(path), {"synthetic": "lora", "kind": kind, "seed": seed, "rank": rank,
                                      "generator": GENERATOR_VERSION, "scale": scale})
    return Path(path)


# --------------------------------------------------------------------------
# cache


def _param_hash(**params) -> str:
    return hashlib.sha1(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:12]


def cached_checkpoint(seed: int = STANDARD_CHECKPOINT_SEED, cache_dir: Path | None = None,
                      manifest: dict | None = None, **manifest_kw) -> Path:
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    manifest = manifest or shape_manifest(cache_dir=cache_dir, **manifest_kw)
    h = _param_hash(seed=seed, v=GENERATOR_VERSION, m=manifest["_id"], std=BASE_STD)
    path = cache_dir / f"ckpt_sd15_{h}.safetensors"
    if not path.exists():
        with _locked(path):
            if not path.exists():
                make_checkpoint(path, seed, manifest=manifest)
    return path


def cached_lora(kind: str, seed: int, rank: int = 4, targets=None, include_clip: bool = True,
                scale: float = DEFAULT_LORA_SCALE, cache_dir: Path | None = None,
                manifest: dict | None = None, **manifest_kw) -> Path:
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    manifest = manifest or shape_manifest(cache_dir=cache_dir, **manifest_kw)
    tg = None if targets is None else sorted([targets] if isinstance(targets, str) else targets)
    h = _param_hash(kind=kind, seed=seed, rank=rank, targets=tg, clip=include_clip, scale=scale,
                    v=GENERATOR_VERSION, m=manifest["_id"], std=BASE_STD)
    path = cache_dir / f"lora_{kind}_{h}.safetensors"
    if not path.exists():
        with _locked(path):
            if not path.exists():
                make_lora(path, kind, seed, rank, targets=targets, include_clip=include_clip, scale=scale,
                          manifest=manifest)
    return path


def ensure_assets(cache_dir: Path | None = None, comfy_root: Path | None = None, python: str | None = None) -> dict:
    """Build (or reuse) the standard synthetic set; return {"checkpoint": path, "loras": {kind: path}}."""
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    manifest = shape_manifest(cache_dir=cache_dir, comfy_root=comfy_root, python=python)
    out = {"checkpoint": str(cached_checkpoint(cache_dir=cache_dir, manifest=manifest)), "loras": {}}
    for name, kw in STANDARD_LORAS.items():
        out["loras"][name] = str(cached_lora(cache_dir=cache_dir, manifest=manifest, **kw))
    return out


def ensure_assets_any_python(cache_dir: Path | None = None, comfy_root: Path | None = None,
                             python: str | None = None, timeout: float = 600.0) -> dict:
    """ensure_assets in this process if it has torch + safetensors, else via ComfyUI's python."""
    try:
        import safetensors.torch  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        root = Path(comfy_root) if comfy_root else _cs.find_comfy_root()
        py = python or _cs.find_comfy_python(root)
        cmd = [py, os.path.abspath(__file__), "assets"]
        if cache_dir:
            cmd += ["--cache", str(cache_dir)]
        env = dict(os.environ)
        if root:
            env["COMFYUI_PATH"] = str(root)
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if res.returncode != 0:
            raise RuntimeError(f"synth assets failed:\n{res.stderr[-4000:]}")
        return json.loads(res.stdout.strip().splitlines()[-1])
    return ensure_assets(cache_dir, comfy_root, python)


def _main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("assets")
    a.add_argument("--cache", default=None)
    c = sub.add_parser("checkpoint")
    c.add_argument("out")
    c.add_argument("--seed", type=int, default=STANDARD_CHECKPOINT_SEED)
    lo = sub.add_parser("lora")
    lo.add_argument("out")
    lo.add_argument("--kind", required=True, choices=sorted(DEFAULT_TARGETS))
    lo.add_argument("--seed", type=int, default=0)
    lo.add_argument("--rank", type=int, default=4)
    lo.add_argument("--targets", default=None, help="comma separated: attn,ff,proj,conv,other or re:<regex>")
    lo.add_argument("--scale", type=float, default=DEFAULT_LORA_SCALE)
    lo.add_argument("--no-clip", action="store_true")
    ns = p.parse_args(argv)
    if ns.cmd == "assets":
        print(json.dumps(ensure_assets(Path(ns.cache) if ns.cache else None)))
    elif ns.cmd == "checkpoint":
        print(make_checkpoint(ns.out, ns.seed))
    else:
        targets = ns.targets.split(",") if ns.targets else None
        print(make_lora(ns.out, ns.kind, ns.seed, ns.rank, targets=targets, include_clip=not ns.no_clip,
                        scale=ns.scale))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
