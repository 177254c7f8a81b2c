"""Every format, applied at runtime, equals the same delta added to the weights by independent math."""

from __future__ import annotations

import copy

import pytest
import torch

from lora_engine import SlotBank, fuse, load_adapter

from .support import lora_files as lf

TOL = 1e-5


def _kohya_prefix(name: str) -> str:
    return "lora_unet_" + name.replace(".", "_")


def ref_lowrank(t, model, layout):
    """ΔW per layer, read back from the file layout by hand."""
    names = {"kohya": (_kohya_prefix, ".lora_down.weight", ".lora_up.weight"),
             "locon-mid": (_kohya_prefix, ".lora_down.weight", ".lora_up.weight"),
             "peft": (lambda n: "unet." + n, ".lora_A.weight", ".lora_B.weight"),
             "peft-default": (lambda n: "base_model.model." + n, ".lora_A.default.weight", ".lora_B.default.weight"),
             "diffusers": (lambda n: "unet." + n, ".lora.down.weight", ".lora.up.weight")}[layout]
    pre, dn, up = names
    out = {}
    for name, shape in lf.weight_shapes(model).items():
        p = pre(name)
        d, u = t[p + dn].double(), t[p + up].double()
        r = d.shape[0]
        alpha = float(t[p + ".alpha"]) if p + ".alpha" in t else r
        mid = t.get(p + ".lora_mid.weight")
        if mid is not None:
            d = torch.einsum("ijhw,jn->inhw", mid.double(), d.reshape(r, -1))
        out[name] = (u.reshape(u.shape[0], -1) @ d.reshape(r, -1)).reshape(shape) * (alpha / r)
    return out


def ref_loha(t, model):
    out = {}
    for name, shape in lf.weight_shapes(model).items():
        p = _kohya_prefix(name)
        w1 = t[p + ".hada_w1_a"].double() @ t[p + ".hada_w1_b"].double()
        w2 = t[p + ".hada_w2_a"].double() @ t[p + ".hada_w2_b"].double()
        out[name] = (w1 * w2).reshape(shape) * float(t[p + ".alpha"]) / t[p + ".hada_w1_b"].shape[0]
    return out


def ref_lokr(t, model):
    out = {}
    for name, shape in lf.weight_shapes(model).items():
        p = _kohya_prefix(name)
        w1 = t[p + ".lokr_w1"].double()
        full_w2 = t.get(p + ".lokr_w2")
        w2 = full_w2.double().reshape(full_w2.shape[0], -1) if full_w2 is not None else \
            (t[p + ".lokr_w2_a"].double() @ t[p + ".lokr_w2_b"].double())
        full = torch.zeros(shape[0], shape[1:].numel(), dtype=torch.float64)
        o2, i2 = w2.shape[0], shape[1] // w1.shape[1]
        k = shape[2:].numel()
        w2 = w2.reshape(o2, i2, k)
        for a in range(w1.shape[0]):
            for b in range(w1.shape[1]):  # the Kronecker product written out
                blk = (w1[a, b] * w2).reshape(o2, i2 * k)
                for c in range(o2):
                    for d in range(i2):
                        full[a * o2 + c, (b * i2 + d) * k:(b * i2 + d + 1) * k] = blk[c, d * k:(d + 1) * k]
        scale = 1.0 if full_w2 is not None else float(t[p + ".alpha"]) / t[p + ".lokr_w2_b"].shape[0]
        out[name] = full.reshape(shape) * scale
    return out


def ref_diff(t, model):
    return {n: t["diffusion_model." + n + ".diff"].double() for n in lf.LAYERS}


def ref_dora(t, model, axis, delta=None):
    """DoRA over the deltas `delta` gives (a kohya LoRA's by default)."""
    base = (delta or (lambda t, m: ref_lowrank(t, m, "kohya")))(t, model)
    mods = dict(model.named_modules())
    out = {}
    for name, d in base.items():
        w = mods[name].weight.detach().double()
        merged = w + d
        mag = t[_kohya_prefix(name) + ".dora_scale"].double()
        if axis == "output":
            norm = merged.reshape(merged.shape[0], -1).norm(dim=1).reshape(mag.shape)
        else:
            norm = merged.transpose(0, 1).reshape(merged.shape[1], -1).norm(dim=1).reshape(mag.shape)
        out[name] = merged * mag / (norm + torch.finfo(torch.float32).eps) - w
    return out


def _rotations(blocks, alpha, outputs):
    """The Cayley rotation R = (I + Q)(I − Q)⁻¹ of each block, Q = P − Pᵀ first scaled to Frobenius norm
    alpha·outputs where alpha > 0 and ‖Q‖ (over all blocks) exceeds it."""
    q = blocks - blocks.transpose(-1, -2)
    if alpha > 0 and float(q.norm()) > alpha * outputs:
        q = q * alpha * outputs / float(q.norm())
    eye = torch.eye(q.shape[-1], dtype=torch.float64)
    return [torch.linalg.solve((eye - qi).T, (eye + qi).T).T for qi in q.reshape(-1, *q.shape[-2:])]


def _butterfly(n, b, stage):
    """The permutation matrix P with P·W = W's rows in stage `stage`'s order: in each group of 2h rows (h = 2^stage
    · b/2), row j of its first half, then row j of its second half, for j = 0 … h − 1."""
    half = (b // 2) << stage
    order = [c * 2 * half + g * half + j for c in range(n // (2 * half)) for j in range(half) for g in range(2)]
    return torch.eye(n, dtype=torch.float64)[order]


def ref_oft(t, model):
    """Diag-OFT: W' = m ⊙ Dᵀ·W with D the block-diagonal matrix of the rotations. BOFT (4-D blocks): W' = m ⊙
    D_{M−1} ⋯ D_0 · W, D_i = P_iᵀ·blockdiag(R_i)·P_i with P_i stage i's butterfly permutation."""
    mods = dict(model.named_modules())
    out = {}
    for name, shape in lf.weight_shapes(model).items():
        p = _kohya_prefix(name)
        blocks = t[p + ".oft_blocks"].double()
        n = shape[0]
        rotations = _rotations(blocks, float(t[p + ".alpha"]), n)
        w = mods[name].weight.detach().double().reshape(n, -1)
        if blocks.dim() == 3:
            rotated = torch.block_diag(*rotations).T @ w
        else:
            stages, k, b, _ = blocks.shape
            rotated = w
            for i in range(stages):
                perm = _butterfly(n, b, i)
                rotated = perm.T @ torch.block_diag(*rotations[i * k:(i + 1) * k]) @ perm @ rotated
        rotated = rotated.reshape(shape)
        if p + ".rescale" in t:
            rotated = rotated * t[p + ".rescale"].double()
        out[name] = rotated - w.reshape(shape)
    return out


def ref_glora(t, model, layout):
    """ΔW = (W·A1·A2 + B1·B2)·alpha/r written out: A1·A2 mixes a conv's input channels at each kernel position in
    the current layout, the flattened inputs in the older one (A2·A1 there, by its names, and B2·B1), and a Tucker
    core runs between B2 and B1."""
    mods = dict(model.named_modules())
    out = {}
    for name, shape in lf.weight_shapes(model).items():
        p = _kohya_prefix(name)
        a1, a2, b1, b2 = (t[f"{p}.{k}.weight"].double() for k in ("a1", "a2", "b1", "b2"))
        w = mods[name].weight.detach().double()
        o, i = shape[0], shape[1]
        if layout == "older":
            d = b2 @ b1 + w.reshape(o, -1) @ a2 @ a1
            rank = a1.shape[0]
        else:
            a1m, a2m = a1.reshape(i, -1), a2.reshape(-1, i)
            mixed = torch.zeros_like(w)
            for c in range(i):
                mixed[:, c] = sum(w[:, j] * (a1m[j] @ a2m[:, c]) for j in range(i))
            if f"{p}.bm.weight" in t:
                b2 = torch.einsum("ij...,jn->in...", t[f"{p}.bm.weight"].double(), b2.reshape(b2.shape[0], -1))
            d = mixed.reshape(o, -1) + b1.reshape(o, -1) @ b2.reshape(b2.shape[0], -1)
            rank = a2.shape[0]
        out[name] = d.reshape(shape) * float(t[p + ".alpha"]) / rank
    return out


CASES = [
    # (name, tensors(model), reference deltas(tensors, model), runtime path)
    ("kohya", lambda m: lf.lora_tensors(m, "kohya", 1), lambda t, m: ref_lowrank(t, m, "kohya"), "low-rank"),
    ("kohya-no-alpha", lambda m: lf.lora_tensors(m, "kohya", 2, alpha=None),
     lambda t, m: ref_lowrank(t, m, "kohya"), "low-rank"),
    ("locon-mid", lambda m: lf.lora_tensors(m, "locon-mid", 3), lambda t, m: ref_lowrank(t, m, "locon-mid"),
     "low-rank"),
    ("peft", lambda m: lf.lora_tensors(m, "peft", 4), lambda t, m: ref_lowrank(t, m, "peft"), "low-rank"),
    ("peft-default", lambda m: lf.lora_tensors(m, "peft-default", 5),
     lambda t, m: ref_lowrank(t, m, "peft-default"), "low-rank"),
    ("diffusers", lambda m: lf.lora_tensors(m, "diffusers", 6), lambda t, m: ref_lowrank(t, m, "diffusers"),
     "low-rank"),
    ("loha", lambda m: lf.loha_tensors(m, 7), ref_loha, "low-rank"),
    ("loha-dense", lambda m: lf.loha_tensors(m, 12, rank=lf.DENSE_LOHA_RANK), ref_loha, "dense"),
    ("lokr", lambda m: lf.lokr_tensors(m, 8), ref_lokr, "low-rank"),
    ("lokr-kron", lambda m: lf.lokr_tensors(m, 13, full_w2=True), ref_lokr, "mixed"),
    ("lokr-dense", lambda m: lf.lokr_tensors(m, 14, full_w2=True, w1_rows=1), ref_lokr, "dense"),
    ("diff", lambda m: lf.diff_tensors(m, 9), ref_diff, "dense"),
    ("dora-input-axis", lambda m: lf.dora_tensors(m, 10, "input"), lambda t, m: ref_dora(t, m, "input"), "dense"),
    ("dora-output-axis", lambda m: lf.dora_tensors(m, 11, "output"), lambda t, m: ref_dora(t, m, "output"),
     "dense"),
    ("oft", lambda m: lf.oft_tensors(m, 15), ref_oft, "dense"),
    # alpha 0.02 bounds ‖Q‖ by 0.02 · outputs on every layer here (test_oft_constraint_binds)
    ("oft-constrained-rescaled", lambda m: lf.oft_tensors(m, 16, constraint=0.02, rescale=True), ref_oft, "dense"),
    ("boft", lambda m: lf.oft_tensors(m, 22, butterfly=True), ref_oft, "dense"),
    ("boft-constrained-rescaled", lambda m: lf.oft_tensors(m, 23, constraint=0.02, rescale=True, butterfly=True),
     ref_oft, "dense"),
    ("boft-dora", lambda m: lf.dora_tensors(m, 24, "output", lf.oft_tensors(m, 24, butterfly=True)),
     lambda t, m: ref_dora(t, m, "output", ref_oft), "dense"),
    # GLoRA: the Linears run its rank-2r form; a 3×3 conv mixes its channels per kernel position, a dense ΔW there
    ("glora", lambda m: lf.glora_tensors(m, 17), lambda t, m: ref_glora(t, m, "current"), "mixed"),
    ("glora-tucker", lambda m: lf.glora_tensors(m, 18, "tucker"), lambda t, m: ref_glora(t, m, "tucker"), "mixed"),
    ("glora-older", lambda m: lf.glora_tensors(m, 19, "older"), lambda t, m: ref_glora(t, m, "older"), "low-rank"),
    # rank 20: on the 16×16 Linears the factors also read as the older layout's rank 16 on a 20×20 layer
    ("glora-rank-above-width", lambda m: lf.glora_tensors(m, 21, rank=20), lambda t, m: ref_glora(t, m, "current"),
     "dense"),
    ("glora-dora", lambda m: lf.dora_tensors(m, 20, "output", lf.glora_tensors(m, 20)),
     lambda t, m: ref_dora(t, m, "output", lambda t, m: ref_glora(t, m, "current")), "dense"),
]


def _reference_model(model, tensors, deltas, strength):
    ref = copy.deepcopy(model)
    mods = dict(ref.named_modules())
    with torch.no_grad():
        for name, d in deltas.items():
            w = mods[name].weight
            w.copy_((w.double() + strength * d).to(w.dtype))
            b = tensors.get("diffusion_model." + name + ".diff_b")
            if b is not None:
                mods[name].bias.add_(strength * b)
    return ref


@pytest.mark.parametrize("name,make,reference,path", CASES, ids=[c[0] for c in CASES])
def test_runtime_matches_independent_math(tmp_path, name, make, reference, path):
    model = lf.tiny()
    x = lf.tiny_input()
    tensors = make(model)
    adapter = load_adapter(lf.write(tmp_path, f"{name}.safetensors", tensors))
    strength = 0.7
    with torch.no_grad():
        base = model(x)
        expected = _reference_model(model, tensors, reference(tensors, model), strength)(x)
        bank = SlotBank(model, max_loras=2)
        bank.activate([(adapter, strength)])
        got = model(x)
    report = bank.report(adapter)
    assert report.matched == len(lf.LAYERS) and not report.unmatched and not report.leftover
    assert report.runtime_path == path
    assert (expected - base).abs().max() > 1e-2  # the adapter has a visible effect
    assert (got - expected).abs().max() <= TOL


@pytest.mark.parametrize("name,make,reference,path", CASES, ids=[c[0] for c in CASES])
def test_fused_equals_runtime(tmp_path, name, make, reference, path):
    model = lf.tiny()
    x = lf.tiny_input()
    adapter = load_adapter(lf.write(tmp_path, f"{name}.safetensors", make(model)))
    with torch.no_grad():
        bank = SlotBank(model, max_loras=1)
        bank.activate([(adapter, -0.6)])
        runtime = model(x)
        bank.release()
        fused_model = copy.deepcopy(model)
        fuse(fused_model, adapter, -0.6)
        fused = fused_model(x)
    assert (fused - runtime).abs().max() <= TOL


def test_formats_are_named_in_the_report(tmp_path):
    model = lf.tiny()
    mixed = {**lf.lora_tensors(model, "kohya", 1, layers=("conv_in", "proj")),
             **{k: v for k, v in lf.loha_tensors(model, 2, rank=lf.DENSE_LOHA_RANK).items() if "lora_unet_head" in k}}
    adapter = load_adapter(lf.write(tmp_path, "mixed.safetensors", mixed))
    assert set(adapter.formats) == {"kohya", "loha"}
    report = SlotBank(model).report(adapter)
    assert (report.low_rank, report.dense, report.runtime_path) == (2, 1, "mixed")


@pytest.mark.parametrize("butterfly", [False, True], ids=["oft", "boft"])
def test_oft_constraint_binds(tmp_path, butterfly):
    """The constrained cases above test the constraint only where it scales Q: on every layer ‖Q‖ exceeds alpha ·
    outputs (the trainers' bound) and alpha itself (ComfyUI's reading of it), so either misreading fails them."""
    model = lf.tiny()
    t = lf.oft_tensors(model, 23 if butterfly else 16, constraint=0.02, rescale=True, butterfly=butterfly)
    for name, shape in lf.weight_shapes(model).items():
        blocks = t[_kohya_prefix(name) + ".oft_blocks"]
        assert float((blocks - blocks.transpose(-1, -2)).norm()) > 0.02 * shape[0] > 0.02
    adapter = load_adapter(lf.write(tmp_path, "oft.safetensors", t))
    assert set(adapter.formats) == ({"oft", "boft"} if butterfly else {"oft"})  # head's 5 outputs: diag-OFT


def test_kohya_oft_names(tmp_path):
    """kohya sd-scripts' OFT writes the same blocks under `oft_unet_<module>`: every layer binds, as under
    `lora_unet_`."""
    model, x = lf.tiny(), lf.tiny_input()
    t = lf.oft_tensors(model, 16, constraint=0.02)
    outputs = []
    for name, tensors in (("lycoris", t), ("kohya", {k.replace("lora_unet_", "oft_unet_"): v for k, v in t.items()})):
        adapter = load_adapter(lf.write(tmp_path, f"{name}.safetensors", tensors))
        bank = SlotBank(model)
        assert bank.report(adapter).matched == len(lf.LAYERS)
        with torch.no_grad():
            bank.activate([(adapter, 0.8)])
            outputs.append(model(x))
            bank.release()
    assert torch.equal(outputs[0], outputs[1])


def test_leftover_keys_are_reported_not_dropped(tmp_path):
    model = lf.tiny()
    t = lf.lora_tensors(model, "kohya", 1, layers=("proj",))
    t["lora_unet_proj.some_unknown_tensor"] = torch.zeros(2)
    t["lora_unet_not_a_layer.lora_down.weight"] = torch.zeros(3, 4)
    t["lora_unet_not_a_layer.lora_up.weight"] = torch.zeros(4, 3)
    adapter = load_adapter(lf.write(tmp_path, "extra.safetensors", t))
    assert adapter.leftover == ("lora_unet_proj.some_unknown_tensor",)
    report = SlotBank(model).report(adapter)
    assert report.unmatched == ("lora_unet_not_a_layer",)
    assert report.partial and "1 unmatched" in report.line() and "1 unparsed" in report.line()


def test_host_mapping_with_output_slices(tmp_path):
    """A host map can point q, k and v LoRAs at slices of one fused qkv Linear (Flux in ComfyUI)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 24)).eval()
    g = torch.Generator().manual_seed(3)
    t, mapping = {}, {}
    for j, part in enumerate("qkv"):
        p = f"transformer.attn.to_{part}"
        t[p + ".lora_A.weight"] = torch.randn(2, 8, generator=g)
        t[p + ".lora_B.weight"] = torch.randn(8, 2, generator=g)
        mapping[p] = ("0.weight", (0, 8 * j, 8))
    adapter = load_adapter(lf.write(tmp_path, "qkv.safetensors", t))
    from lora_engine import KeyMap
    bank = SlotBank(model, keymap=KeyMap(model, mapping))
    x = torch.randn(3, 8)
    with torch.no_grad():
        w = model[0].weight.clone()
        delta = torch.cat([t[f"transformer.attn.to_{p}.lora_B.weight"] @ t[f"transformer.attn.to_{p}.lora_A.weight"]
                           for p in "qkv"])
        expected = torch.nn.functional.linear(x, w + 0.5 * delta, model[0].bias)
        bank.activate([(adapter, 0.5)])
        got = model(x)
    assert bank.report(adapter).matched == 1
    assert (got - expected).abs().max() <= TOL


@pytest.mark.parametrize("conf,scale_of", [
    ({"r": 3, "lora_alpha": 6}, lambda name, r: 6 / r),
    ({"r": 3, "lora_alpha": 6, "alpha_pattern": {"ff": 1.5}}, lambda name, r: (1.5 if name == "ff" else 6) / r),
    ({"r": 3, "lora_alpha": 6, "use_rslora": True}, lambda name, r: 6 / r ** 0.5),
    ({"transformer.r": 3, "transformer.lora_alpha": 9}, lambda name, r: 9 / r),
], ids=["lora_alpha", "alpha_pattern", "rslora", "pipeline-prefixed"])
def test_peft_alpha_from_the_header(tmp_path, conf, scale_of):
    """diffusers' save_lora_adapter keeps alpha only in the header's `lora_adapter_metadata`."""
    import json
    model = lf.tiny()
    t = lf.lora_tensors(model, "peft", 4, alpha=None)
    path = lf.write(tmp_path, "meta.safetensors", t, metadata={"lora_adapter_metadata": json.dumps(conf)})
    adapter = load_adapter(path)
    for name in lf.LAYERS:
        lp = adapter.layers["unet." + name]
        assert lp.weight.scale == pytest.approx(scale_of(name, lp.weight.rank)), name


class CastLinear(torch.nn.Linear):
    """Stores its weight in fp8 and casts it in forward, as ComfyUI's manual-cast and GGUF layers do."""

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), self.bias)


class Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv1d(4, 6, 3, padding=1)
        self.c3 = torch.nn.Conv3d(6, 5, (1, 3, 3), padding=(0, 1, 1), stride=(1, 2, 2))
        self.q = CastLinear(5, 7)
        self.q.weight.data = self.q.weight.data.to(torch.float8_e4m3fn)

    def forward(self, x):  # x: [B, 4, 8]
        h = torch.relu(self.c1(x))  # [B, 6, 8]
        h = self.c3(h.reshape(h.shape[0], 6, 1, 2, 4).expand(-1, -1, 2, -1, -1).contiguous())
        return self.q(h.mean(dim=(2, 3, 4)))


@pytest.mark.parametrize("layout", ["kohya", "loha"])
def test_conv1d_conv3d_and_a_casting_fp8_layer(tmp_path, layout):
    torch.manual_seed(0)
    model = Mixed().eval()
    g = torch.Generator().manual_seed(5)
    t = {}
    shapes = {"c1": (6, 4, 3), "c3": (5, 6, 1, 3, 3), "q": (7, 5)}
    for name, shape in shapes.items():
        p = "lora_unet_" + name
        if layout == "kohya":
            t[p + ".lora_down.weight"] = torch.randn(2, *shape[1:], generator=g) * 0.3
            t[p + ".lora_up.weight"] = torch.randn(shape[0], 2, *[1] * (len(shape) - 2), generator=g) * 0.3
        else:
            rest = torch.Size(shape[1:]).numel()
            t[p + ".hada_w1_a"], t[p + ".hada_w1_b"] = torch.randn(shape[0], 2, generator=g), torch.randn(2, rest, generator=g)
            t[p + ".hada_w2_a"], t[p + ".hada_w2_b"] = torch.randn(shape[0], 2, generator=g), torch.randn(2, rest, generator=g)
        t[p + ".alpha"] = torch.tensor(1.0)
    adapter = load_adapter(lf.write(tmp_path, "mixed.safetensors", t))
    x = torch.randn(3, 4, 8, generator=g)
    with torch.no_grad():
        base = model(x)
        ref = copy.deepcopy(model)
        mods = dict(ref.named_modules())
        for name, shape in shapes.items():
            lp = adapter.layers["lora_unet_" + name]
            w = mods[name].weight
            mods[name].weight.data = (w.float() + 0.9 * lp.weight.delta(torch.Size(shape))).to(w.dtype) \
                if name != "q" else w.float() + 0.9 * lp.weight.delta(torch.Size(shape))
        expected = ref(x)
        SlotBank(model, max_loras=1).activate([(adapter, 0.9)])
        got = model(x)
    assert model.q.weight.dtype == torch.float8_e4m3fn  # the runtime never touched the fp8 weight
    assert (expected - base).abs().max() > 1e-2
    assert (got - expected).abs().max() <= 1e-4


def _swap_halves(w):
    shift, scale = w.chunk(2, dim=0)
    return torch.cat([scale, shift], dim=0)


@pytest.mark.parametrize("layout", ["peft", "diff"])
def test_host_mapping_with_a_row_reordering_function(tmp_path, layout):
    """ComfyUI maps Flux's norm_out.linear as (key, None, swap_scale_shift): the delta's halves swap."""
    from lora_engine import KeyMap
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8)).eval()
    g = torch.Generator().manual_seed(4)
    if layout == "peft":
        t = {"transformer.norm_out.linear.lora_A.weight": torch.randn(2, 6, generator=g),
             "transformer.norm_out.linear.lora_B.weight": torch.randn(8, 2, generator=g)}
        delta = t["transformer.norm_out.linear.lora_B.weight"] @ t["transformer.norm_out.linear.lora_A.weight"]
    else:
        t = {"transformer.norm_out.linear.diff": torch.randn(8, 6, generator=g)}
        delta = t["transformer.norm_out.linear.diff"]
    adapter = load_adapter(lf.write(tmp_path, "swap.safetensors", t))
    mapping = {"transformer.norm_out.linear": ("0.weight", None, _swap_halves),
               "transformer.other": ("0.weight", None, lambda w: w * 2)}  # not a reordering: not applied
    keymap = KeyMap(model, mapping, defaults=False)
    assert keymap.resolve("transformer.other") is None
    x = torch.randn(3, 6, generator=g)
    with torch.no_grad():
        expected = torch.nn.functional.linear(x, model[0].weight + 0.7 * _swap_halves(delta), model[0].bias)
        bank = SlotBank(model, keymap=keymap)
        bank.activate([(adapter, 0.7)])
        got = model(x)
    assert bank.report(adapter).runtime_path == ("low-rank" if layout == "peft" else "dense")
    assert (got - expected).abs().max() <= TOL
