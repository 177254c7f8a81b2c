"""Quantized bases in one process: ComfyUI's own loaders for each storage of a diffusion model, and a LoRA stack on
them through this pack, through ComfyUI's stock loader and through its bypass loader. Used by bench/quant_bench.py
and tests/host/support/quant_check.py; run with ComfyUI's python (nothing in ComfyUI is mocked or changed).

Storages (`STORAGES`), each loaded by the node a user loads it with:
  fp8_e4m3fn, fp8_e5m2   UNETLoader's weight_dtype on the full-precision file: every weight cast to fp8 at load
  mixed <format>         ComfyUI's mixed-precision file (tools/quant_files.py), UNETLoader default: the block Linears
                         in float8_e4m3fn, float8_e5m2, nvfp4, mxfp8, int8_tensorwise or convrot_w4a4
  GGUF Q8_0, GGUF Q4_K   a GGUF file through ComfyUI-GGUF's UnetLoaderGGUF (tools/quant_files.py)
`REFERENCE` is the full-precision file through UNETLoader default: fp32 weights on the CPU.

Paths (`Host.apply`): "ours" (LoRAStack nodes → MultiLoRALoader), "stock" (a chain of LoraLoaderModelOnly, the model
half of LoraLoader: `comfy.sd.load_lora_for_models`), "bypass" (LoraLoaderBypassModelOnly; a stock chain of them
keeps only its last LoRA, so for k > 1 each node's own injection is composed into one, injected in order and ejected
in reverse, as bench/compare.py does). Each path keeps its node instances between runs, as ComfyUI keeps a node's
instance between prompts (the stock loaders remember the last file they read).

Models: `Flux` (ComfyUI's Flux class with random weights, any width; conditioning drawn at random; the image is
ComfyUI's own latent preview of the sample, `latent_rgb_factors`, in 0..255 without rounding) and `SD15` (the
synthetic SD1.5 checkpoint of tools/synth.py: its UNet alone as the file, its CLIP for the prompt, its VAE for the
image).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from tools.comfy_inprocess import (build_flux, flux_lora_targets, flux_lora_tensors, import_comfy, import_engine,
                                   import_node_module, import_pack)
from tools.quant_files import block_linears, mixed_precision, write_gguf


@dataclass(frozen=True)
class Storage:
    name: str
    kind: str  # "unet": UNETLoader's weight_dtype; "mixed": a mixed-precision file; "gguf": a GGUF file
    arg: str   # the weight_dtype, the QUANT_ALGOS format, the GGML type

    @property
    def slug(self) -> str:
        return self.name.replace(" ", "_").lower()


REFERENCE = Storage("fp32", "unet", "default")
STORAGES = (
    Storage("fp8_e4m3fn", "unet", "fp8_e4m3fn"),
    Storage("fp8_e5m2", "unet", "fp8_e5m2"),
    *(Storage(f"mixed {f}", "mixed", f) for f in ("float8_e4m3fn", "float8_e5m2", "nvfp4", "mxfp8",
                                                   "int8_tensorwise", "convrot_w4a4")),
    Storage("GGUF Q8_0", "gguf", "Q8_0"),
    Storage("GGUF Q4_K", "gguf", "Q4_K"),
)


def as_prompt(fn):
    """`fn` under `torch.inference_mode()`, as ComfyUI's executor runs every node of a prompt (its models are loaded,
    patched and sampled there)."""
    import functools

    @functools.wraps(fn)
    def run(*args, **kwargs):
        import torch
        with torch.inference_mode():
            return fn(*args, **kwargs)
    return run


def storage_named(name: str) -> Storage:
    for s in (REFERENCE, *STORAGES):
        if name in (s.name, s.slug):
            return s
    raise KeyError(f"no storage {name!r}; one of {[s.slug for s in (REFERENCE, *STORAGES)]}")


def image_error(a, b) -> tuple[float, float]:
    """(the worst channel's mean |a − b|, the largest |a − b|) of two images [H, W, 3] in levels of 1/255."""
    d = (a.double() - b.double()).abs().reshape(-1, a.shape[-1])
    return float(d.mean(dim=0).max()), float(d.max())


def weights_of(model) -> dict:
    """Every parameter and buffer of the diffusion model as stored: name → (class, dtype, shape, its bytes and
    those of any scale it carries, copied). ComfyUI's QuantizedTensor keeps its data and scales beside it,
    ComfyUI-GGUF's GGMLTensor its quantized bytes in itself."""
    import torch
    out = {}
    root = model.model.diffusion_model
    for name, t in [*root.named_parameters(), *root.named_buffers()]:
        parts = [t._qdata] + [v for v in vars(t._params).values() if isinstance(v, torch.Tensor)] \
            if hasattr(t, "_qdata") else [t.data.as_subclass(torch.Tensor)]
        raw = [p.detach().reshape(-1).view(torch.uint8).clone() if p.numel() else p.detach().clone() for p in parts]
        out[name] = (type(t).__name__, str(t.dtype), tuple(t.shape), raw)
    return out


def changed_weights(before: dict, after: dict) -> list[str]:
    """The names whose class, dtype, shape or bytes differ between two `weights_of`, or that one lacks."""
    import torch
    names = sorted(set(before) | set(after))
    return [n for n in names if n not in before or n not in after or before[n][:3] != after[n][:3]
            or len(before[n][3]) != len(after[n][3])
            or not all(torch.equal(x, y) for x, y in zip(before[n][3], after[n][3]))]


def dequantized_state(model) -> dict:
    """The diffusion model's weights as its layers compute with them, in fp32: ComfyUI's QuantizedTensor through its
    own `dequantize`, a GGUF layer through ComfyUI-GGUF's `get_weight`, an fp8 weight cast as ComfyUI's manual cast
    casts it. Keyed as the model's file is, for UNETLoader to load as a full-precision model."""
    import torch
    out = {}
    root = model.model.diffusion_model
    for mname, module in root.named_modules():
        for pname, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            key = f"{mname}.{pname}" if mname else pname
            with torch.no_grad():
                if hasattr(t, "_qdata"):
                    value = t.dequantize()
                elif getattr(t, "tensor_type", None) is not None and hasattr(module, "get_weight"):
                    value = module.get_weight(t, torch.float32)
                else:
                    value = t.detach()
            out[key] = value.to(torch.float32).contiguous() if value.is_floating_point() else value.contiguous()
    return out


@dataclass
class Flux:
    """ComfyUI's Flux of `hidden` width (heads of 128), `depth` double and `single` single blocks, random weights;
    `tokens` image tokens (a square number) and `txt_tokens` text tokens per model call."""

    hidden: int = 3072
    depth: int = 1
    single: int = 1
    tokens: int = 64
    txt_tokens: int = 16
    seed: int = 0
    label: str = "flux"
    arch: str = "flux"
    inputs: dict = field(default_factory=dict)

    def write_base(self, host: Host, path: Path) -> None:
        torch = host.torch
        patcher = build_flux(host.comfy, torch, self.hidden, self.depth, self.single, torch.float32,
                             torch.device("cpu"))
        host.save({k: v.contiguous() for k, v in patcher.model.diffusion_model.state_dict().items()}, path)

    def prepare(self, host: Host) -> None:
        torch = host.torch
        g = torch.Generator().manual_seed(1)
        side = 2 * int(self.tokens ** 0.5)
        self.inputs = {"noise": torch.randn(1, 16, side, side, generator=g),
                       "positive": [[torch.randn(1, self.txt_tokens, 4096, generator=g),
                                     {"pooled_output": torch.randn(1, 768, generator=g), "guidance": 3.5}]]}
        fmt = host.comfy.latent_formats.Flux()
        self.rgb = (torch.tensor(fmt.latent_rgb_factors), torch.tensor(fmt.latent_rgb_factors_bias), fmt)

    def image(self, host: Host, samples):
        factors, bias, fmt = self.rgb
        x0 = fmt.process_in(samples.float())[0].movedim(0, -1)
        return ((host.torch.nn.functional.linear(x0, factors.t(), bias) + 1.0) / 2.0).clamp(0, 1) * 255.0

    def write_loras(self, host: Host, model, k: int, rank: int = 32) -> list[str]:
        """k kohya LoRAs of `rank` on every block Linear (bf16, alpha = rank; ΔW about 11 % of W's spread)."""
        targets = flux_lora_targets(host.comfy, host.torch, model.model)
        names = []
        for i in range(k):
            name = f"{self.label}_h{self.hidden}_r{rank}_{i}.safetensors"
            path = host.folder("loras") / name
            if not path.exists():
                host.save(flux_lora_tensors(host.torch, targets, 1000 + i, rank), path)
            names.append(name)
        return names


@dataclass
class SD15:
    """The synthetic SD1.5 checkpoint (tools/synth.py): its UNet as the file, its CLIP for the prompt (encoded once),
    its VAE for the image; `size`×`size` pixels."""

    checkpoint: str
    loras: dict
    size: int = 64
    label: str = "sd15"
    arch: str = "sd1"
    inputs: dict = field(default_factory=dict)

    def write_base(self, host: Host, path: Path) -> None:
        from safetensors import safe_open
        prefix = "model.diffusion_model."
        with safe_open(self.checkpoint, "pt") as f:
            host.save({k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}, path)

    @as_prompt
    def prepare(self, host: Host) -> None:
        torch = host.torch
        _, clip, self.vae, _ = host.comfy.sd.load_checkpoint_guess_config(self.checkpoint, output_model=False)
        tokens = clip.tokenize("a photograph of a lighthouse on a cliff at dusk")
        positive = [[*clip.encode_from_tokens(tokens, return_pooled=True)]]
        positive = [[positive[0][0], {"pooled_output": positive[0][1]}]]
        side = self.size // 8
        self.inputs = {"noise": torch.randn(1, 4, side, side, generator=torch.Generator().manual_seed(1)),
                       "positive": positive}

    @as_prompt
    def image(self, host: Host, samples):
        return self.vae.decode(samples)[0].float() * 255.0

    def write_loras(self, host: Host, model, k: int, rank: int = 0) -> list[str]:
        """The first k of `loras` (name → synthetic file: tools/synth.py's kohya, PEFT, LoCon, ...)."""
        names = list(self.loras)[:k]
        for name in names:
            host.place(self.loras[name], host.folder("loras") / name)
        return names


class Host:
    """ComfyUI in-process (`--cpu`) with this pack and, where it is found, ComfyUI-GGUF, loaded as ComfyUI loads
    custom nodes; diffusion_models and loras folders of its own under `workdir`; storage files cached in `cache`."""

    def __init__(self, comfy_root: Path, workdir: Path, cache: Path, gguf_path: Path | None = None):
        self.comfy = import_comfy(comfy_root, "cpu")
        import comfy_extras.nodes_lora_debug as lora_debug
        import folder_paths
        import nodes as comfy_nodes
        import torch
        self.torch, self.nodes, self.lora_debug = torch, comfy_nodes, lora_debug
        self.pack = import_pack()
        self.ours_nodes = (import_node_module("stack").LoRAStack, import_node_module("loader").MultiLoRALoader)
        self.workdir, self.cache = Path(workdir), Path(cache)
        for sub in ("diffusion_models", "loras"):
            self.folder(sub).mkdir(parents=True, exist_ok=True)
            folder_paths.add_model_folder_path(sub, str(self.folder(sub)), is_default=True)
        self.cache.mkdir(parents=True, exist_ok=True)
        self.gguf_loader, self.gguf_missing = None, None
        env = os.environ.get("COMFYUI_GGUF_PATH")
        path = gguf_path or (Path(env).expanduser() if env else comfy_root / "custom_nodes" / "ComfyUI-GGUF")
        if not (path / "nodes.py").is_file():
            self.gguf_missing = f"no ComfyUI-GGUF at {path} (set COMFYUI_GGUF_PATH)"
        elif not asyncio.run(comfy_nodes.load_custom_node(str(path))):
            self.gguf_missing = f"ComfyUI-GGUF at {path} does not import here (is `gguf` in ComfyUI's python?)"
        else:
            self.gguf_loader = comfy_nodes.NODE_CLASS_MAPPINGS["UnetLoaderGGUF"]  # registered by the load

    def folder(self, sub: str) -> Path:
        return self.workdir / sub

    def save(self, sd: dict, path: Path) -> None:
        from safetensors.torch import save_file
        tmp = f"{path}.partial"
        save_file(sd, tmp)
        os.replace(tmp, path)

    def place(self, src, dst: Path) -> None:
        """A real file at `dst` (the pack refuses a LoRA that resolves outside its folders): a hard link, else a
        copy."""
        if dst.exists():
            return
        try:
            os.link(src, dst)
        except OSError:
            import shutil
            shutil.copyfile(src, dst)

    def missing(self, storage: Storage) -> str | None:
        """Why `storage` cannot load here, or None."""
        return self.gguf_missing if storage.kind == "gguf" else None

    def storage_file(self, storage: Storage, base: Path, arch: str) -> tuple[str, str]:
        """(the file name in diffusion_models, a note on what it holds) of `storage` made from the full-precision
        file `base`, written once into the cache and linked."""
        if storage.kind == "unet":
            name = base.name
            target, note = base, "the full-precision file"
        else:
            ext = "gguf" if storage.kind == "gguf" else "safetensors"
            target = self.cache / f"{base.stem}.{storage.slug}.{ext}"
            note_file = target.with_name(target.name + ".txt")
            if not target.exists():
                if storage.kind == "gguf":
                    note = str(write_gguf(str(base), str(target), storage.arg, arch))
                else:
                    from safetensors.torch import load_file
                    sd = load_file(str(base))
                    keys = block_linears(sd)
                    out, done = mixed_precision(sd, storage.arg, keys)
                    self.save(out, target)
                    note = f"{done} of {len(keys)} block Linears in {storage.arg}"
                note_file.write_text(note)
            note = note_file.read_text() if note_file.exists() else ""
            name = target.name
        link = self.folder("diffusion_models") / name
        if not link.exists():
            os.symlink(target, link)
        return name, note

    @as_prompt
    def load(self, storage: Storage, base: Path, arch: str):
        """`storage` of the full-precision file `base` through its node; `arch`: the GGUF label (flux, sd1)."""
        name, _ = self.storage_file(storage, base, arch)
        if storage.kind == "gguf":
            return self.gguf_loader().load_unet(name)[0]
        return self.nodes.UNETLoader().load_unet(name, storage.arg if storage.kind == "unet" else "default")[0]

    def chain(self, path: str, depth: int) -> list:
        """Node instances for one path's chain of `depth` entries, to keep between runs."""
        if path == "ours":
            return [self.ours_nodes[0]() for _ in range(depth)] + [self.ours_nodes[1]()]
        if path == "stock":
            return [self.nodes.LoraLoaderModelOnly() for _ in range(depth)]
        return [self.lora_debug.LoraLoaderBypassModelOnly() for _ in range(depth)]

    @as_prompt
    def apply(self, path: str, model, stack, chain: list | None = None):
        """`model` with `stack` ((name, strength) pairs) through `path`'s nodes (`chain`, else new instances)."""
        chain = chain or self.chain(path, len(stack))
        if path == "ours":
            items = None
            for node, (name, s) in zip(chain, stack):
                items = node.stack(name, s, 0.0, lora_stack=items)[0]
            return chain[-1].apply(model, items)[0]
        if path == "stock":
            for node, (name, s) in zip(chain, stack):
                model = node.load_lora_model_only(model, name, s)[0]
            return model
        parts = [node.load_lora_model_only(model, name, s)[0] for node, (name, s) in zip(chain, stack)]
        if len(parts) == 1:
            return parts[0]
        injections = [i for p in parts for i in p.get_injections("bypass_lora")]
        out = model.clone()
        out.set_injections("bypass_lora", [self.comfy.patcher_extension.PatcherInjection(
            inject=lambda mp: [i.inject(mp) for i in injections],
            eject=lambda mp: [i.eject(mp) for i in reversed(injections)])])
        return out

    @as_prompt
    def sample(self, spec, model, steps: int = 2, marks: list | None = None):
        """The sampled latent (Euler, cfg 1, one seed), as a KSampler samples it; `marks` gets the time at the end of
        each step (the sampler's per-step callback: ComfyUI loads and patches the model before step 1)."""
        callback = (lambda *a: marks.append(time.perf_counter())) if marks is not None else None
        positive = spec.inputs["positive"]
        noise = spec.inputs["noise"]
        return self.comfy.sample.sample(model, noise, steps, 1.0, "euler", "simple", positive, positive,
                                        self.torch.zeros_like(noise), disable_pbar=True, seed=7, callback=callback)

    @as_prompt
    def load_models(self, *models) -> None:
        """ComfyUI's load of `models` for sampling (a fused stock model is patched here)."""
        self.comfy.model_management.load_models_gpu(list(models))

    @as_prompt
    def unload(self) -> None:
        """ComfyUI's unload of every model (what POST /free does), then a garbage collection."""
        import gc
        self.comfy.model_management.unload_all_models()
        gc.collect()

    def cache_misses(self) -> int:
        return import_engine().default_cache().stats().misses
