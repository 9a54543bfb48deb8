#!/usr/bin/env python3
"""Independent PyTorch re-implementation of the xdmoe forward pass (docs/model.md).

Written from the spec, not from the C++ model, so tests/model_torch_reference_test.cc can
cross-check the hand-written forward and backward. Needs only the Python standard
library and torch; safetensors files are read and written by hand.

  mixtral_reference.py --checkpoint DIR --batch BATCH.safetensors --out OUT.safetensors
                       [--noise-seed S --noise-step K --noise-first-row R]

DIR holds config.json and model.safetensors (an xdmoe checkpoint). BATCH holds I64
or I32 tensors `inputs` and `targets` of shape (B, T). Everything is computed in
float64. OUT receives `logits` (B*T, V) F32, the F64 scalars `loss` (ce + aux_coef *
sum aux + z_coef * sum z), `ce_loss`, `aux_loss`, `z_loss` (the last two summed over
layers, before their coefficients), and `grad.<name>` (F64) for every parameter: the
gradient of `loss`.

The three --noise-* flags (all or none) evaluate the `gshard_noisy_topk` router in
training mode, with the deterministic router noise of docs/model.md keyed by seed S,
step K and the global index R of the batch's first sequence. Without them the router
is evaluated without noise, as at evaluation. Other gatings ignore them.
"""
import argparse
import json
import math
import os
import struct
import sys

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class ReferenceError(Exception):
    pass


# ---------------------------------------------------------------- safetensors I/O
def read_safetensors(path):
    if not os.path.isfile(path):
        raise ReferenceError(f"{path}: file not found")
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ReferenceError(f"{path}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise ReferenceError(f"{path}: header length {n} runs past the end of the file")
    try:
        header = json.loads(raw[8:8 + n].decode("utf-8"))
    except ValueError as e:
        raise ReferenceError(f"{path}: bad header JSON: {e}")
    data = bytearray(raw[8 + n:])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info.get("dtype") not in DTYPES:
            raise ReferenceError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
        dtype, shape = DTYPES[info["dtype"]], [int(s) for s in info["shape"]]
        b, e = info["data_offsets"]
        numel = math.prod(shape)
        if e > len(data) or e - b != numel * torch.tensor([], dtype=dtype).element_size():
            raise ReferenceError(f"{path}: tensor {name!r} has inconsistent data_offsets")
        t = torch.frombuffer(data, dtype=dtype, count=numel, offset=b) if numel else torch.empty(0, dtype=dtype)
        out[name] = t.clone().reshape(shape)
    return out


def write_safetensors(path, tensors):
    header, blobs, pos = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        b = t.numpy().tobytes()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [pos, pos + len(b)]}
        blobs.append(b)
        pos += len(b)
    h = json.dumps(header).encode("utf-8")
    h += b" " * (-len(h) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    os.replace(tmp, path)


# ---------------------------------------------------------------- model
def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, theta):  # x: (B, T, heads, hd); rotate-half convention
    T, hd = x.shape[1], x.shape[3]
    inv = theta ** (-torch.arange(0, hd // 2, dtype=torch.float64) * 2.0 / hd)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]  # (T, hd/2)
    c, s = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def attention(x, P, pre, cfg, B, T):
    H, KVH, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    hd = d // H
    q = (x @ P[pre + "q_proj.weight"].T).view(B, T, H, hd)
    k = (x @ P[pre + "k_proj.weight"].T).view(B, T, KVH, hd)
    v = (x @ P[pre + "v_proj.weight"].T).view(B, T, KVH, hd)
    q, k = rope(q, cfg["rope_theta"]), rope(k, cfg["rope_theta"])
    k = k.repeat_interleave(H // KVH, dim=2)
    v = v.repeat_interleave(H // KVH, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B * T, H * hd)
    return out @ P[pre + "o_proj.weight"].T


def swiglu(x, P, pre):
    return (torch.nn.functional.silu(x @ P[pre + "w1.weight"].T) * (x @ P[pre + "w3.weight"].T)) @ P[pre + "w2.weight"].T


GATINGS = ("softmax_topk", "sigmoid_topk", "expert_choice", "gshard_noisy_topk", "xmoe", "soft_moe")
MASK64 = (1 << 64) - 1


def check_gating(cfg):
    """The gating's name; resolves xdmoe_router_dim (0 or absent: E / 2, at least 1) and
    xdmoe_soft_moe_slots (absent: 1) in cfg."""
    gating = cfg.get("xdmoe_gating", "softmax_topk")
    if gating not in GATINGS:
        raise ReferenceError(f"config key \"xdmoe_gating\": unknown gating {gating!r}")
    for key, default, low, user in (("xdmoe_router_dim", 0, 0, "xmoe"), ("xdmoe_soft_moe_slots", 1, 1, "soft_moe")):
        if gating != user:
            continue
        v = cfg.setdefault(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ReferenceError(f"config key \"{key}\" must be an integer >= {low}, not {v!r}")
    if gating == "xmoe" and cfg["xdmoe_router_dim"] == 0:
        cfg["xdmoe_router_dim"] = max(1, cfg["num_local_experts"] // 2)
    return gating


def router_shapes(cfg):
    """The router tensors of one layer (names relative to block_sparse_moe.) and their shapes."""
    gating = check_gating(cfg)
    E, d = cfg["num_local_experts"], cfg["hidden_size"]
    if gating == "xmoe":
        de = cfg["xdmoe_router_dim"]
        return {"gate.weight": (de, d), "gate_experts.weight": (E, de), "gate_log_scale": (1,)}
    if gating == "soft_moe":
        return {"gate.weight": (E * cfg["xdmoe_soft_moe_slots"], d)}
    if gating == "gshard_noisy_topk":
        return {"gate.weight": (E, d), "gate_noise.weight": (E, d)}
    return {"gate.weight": (E, d)}


def splitmix64(v):
    v = (v + 0x9E3779B97F4A7C15) & MASK64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & MASK64
    return v ^ (v >> 31)


def token_noise(seed, step, layer, g, E):
    """E standard normal draws for global token g of layer `layer` (docs/model.md)."""
    key = splitmix64((seed ^ 0x6E6F6973652D7865) & MASK64)
    for v in (step, layer, g):
        key = splitmix64(key ^ (v & MASK64))
    state = key

    def uniform():
        nonlocal state
        r = splitmix64(state)
        state = (state + 1) & MASK64
        return (r >> 11) * (1.0 / 9007199254740992.0)

    out = []
    for _ in range(E):
        u1, u2 = uniform(), uniform()
        if u1 < 1e-300:
            u1 = 1e-300
        out.append(math.sqrt(-2.0 * math.log(u1)) * math.cos(6.283185307179586 * u2))
    return out


def router_noise(noise, layer, B, T, E):
    """eps (N, E) for row n = b*T + t, from global token g = (first_row + b)*T + t."""
    seed, step, first_row = noise
    rows = [token_noise(seed, step, layer, (first_row + b) * T + t, E) for b in range(B) for t in range(T)]
    return torch.tensor(rows, dtype=torch.float64)


def soft_moe(x, P, pre, cfg, B, T):
    """Causal SoftMoE: returns (routed, slot logits L)."""
    E, p, d = cfg["num_local_experts"], cfg["xdmoe_soft_moe_slots"], x.shape[1]
    slots = E * p
    L = x @ P[pre + "gate.weight"].T  # (N, E*p), slot j = e*p + q belongs to expert e
    Lb = L.view(B, T, slots).permute(0, 2, 1)  # (B, E*p, T): [b, j, u]
    scores = Lb[:, :, None, :].expand(B, slots, T, T)  # [b, j, t, u] = L[(b, u), j]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)  # u > t
    D = scores.masked_fill(future, float("-inf")).softmax(-1)  # dispatch, over the prefix u <= t
    xs = torch.einsum("bjtu,bud->btjd", D, x.view(B, T, d))  # slot inputs (B, T, E*p, d)
    ys = torch.cat([swiglu(xs[:, :, e * p:(e + 1) * p, :].reshape(-1, d), P, f"{pre}experts.{e}.").view(B, T, p, d)
                    for e in range(E)], dim=2).view(B * T, slots, d)  # slot outputs
    w = L.softmax(-1)  # combine weights, over the slots (N, E*p)
    return (w[:, :, None] * ys).sum(1), L


def moe(x, P, pre, cfg, layer, B, T, noise=None):
    """Returns (shared, routed, aux, z) for the normed input x (N, d) of layer `layer`."""
    N = x.shape[0]
    E, k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    gating = check_gating(cfg)
    shared = torch.zeros_like(x)
    for j in range(cfg.get("xdmoe_num_shared_experts", 0)):
        shared = shared + swiglu(x, P, f"{pre}shared_experts.{j}.")
    if gating == "soft_moe":  # no drops, no capacity, no balancing loss
        routed, L = soft_moe(x, P, pre, cfg, B, T)
        z = torch.logsumexp(L, dim=-1).pow(2).mean()
        return shared, routed, torch.zeros((), dtype=x.dtype), z
    if gating == "xmoe":
        h = x @ P[pre + "gate.weight"].T  # (N, d_e)
        h = h / h.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        e = P[pre + "gate_experts.weight"]  # (E, d_e)
        e = e / e.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        logits = P[pre + "gate_log_scale"].exp() * (h @ e.T)  # (N, E)
    else:
        logits = x @ P[pre + "gate.weight"].T  # (N, E)
        if gating == "gshard_noisy_topk" and noise is not None:
            raw = x @ P[pre + "gate_noise.weight"].T
            logits = logits + router_noise(noise, layer, B, T, E) * torch.nn.functional.softplus(raw)
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    if gating == "xmoe":  # bounded cosine logits: no z-loss (X-MoE has none)
        z = torch.zeros((), dtype=x.dtype)
    if gating in ("gshard_noisy_topk", "xmoe"):
        gating = "softmax_topk"  # the same top-k routing on these logits
    factor = cfg.get("xdmoe_capacity_factor", 0.0)
    if factor <= 0 and gating == "expert_choice":
        factor = 1.0
    C = N if factor <= 0 else min(N, math.ceil(factor * N * k / E))
    W = torch.zeros(N, E, dtype=x.dtype)  # combine weight of expert e for token n
    if gating in ("softmax_topk", "sigmoid_topk"):
        score = logits.softmax(-1) if gating == "softmax_topk" else logits.sigmoid()
        # k largest, ties to the lower expert index (stable descending sort)
        idx = torch.sort(score.detach(), dim=-1, descending=True, stable=True).indices[:, :k]
        chosen = torch.zeros(N, E, dtype=torch.bool).scatter_(1, idx, True)
        w = torch.where(chosen, score, torch.zeros_like(score))
        w = w / w.sum(-1, keepdim=True)
        f = chosen.to(x.dtype).sum(0) / (N * k)  # before drops, not differentiated
        Pm = (score if gating == "softmax_topk" else score / score.sum(-1, keepdim=True)).mean(0)
        aux = E * (f * Pm).sum()
        # capacity: each expert keeps its first C assignments in token order
        keep = chosen & (chosen.to(torch.int64).cumsum(0) <= C)
        W = torch.where(keep, w, W)
    else:  # expert_choice
        p = logits.softmax(-1)
        idx = torch.sort(p.detach(), dim=0, descending=True, stable=True).indices[:C, :]  # (C, E)
        chosen = torch.zeros(N, E, dtype=torch.bool).scatter_(0, idx, True)
        W = torch.where(chosen, p, W)
        aux = torch.zeros((), dtype=x.dtype)
    # Dense evaluation: W is 0 where a token has no (kept) assignment to e.
    routed = sum(W[:, e:e + 1] * swiglu(x, P, f"{pre}experts.{e}.") for e in range(E))
    return shared, routed, aux, z


def forward(P, cfg, inputs, targets, noise=None):
    B, T = inputs.shape
    L, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    conn = cfg.get("xdmoe_connectivity") or ["regular"] * L
    if len(conn) != L:
        raise ReferenceError(f"config key \"xdmoe_connectivity\" has {len(conn)} entries for {L} layers")
    o = P["model.embed_tokens.weight"][inputs.reshape(-1)]
    r = torch.zeros_like(o)
    aux_sum = z_sum = torch.zeros((), dtype=torch.float64)
    for i in range(L):
        c, pre = conn[i], f"model.layers.{i}."
        if c not in ("regular", "farskip", "farskip_attention", "farskip_moe"):
            raise ReferenceError(f"config key \"xdmoe_connectivity[{i}]\": unknown value {c!r}")
        attn_in = o - r if c in ("farskip", "farskip_attention") else o
        a = attention(rms_norm(attn_in, P[pre + "input_layernorm.weight"], eps), P, pre + "self_attn.", cfg, B, T)
        moe_in = o if c in ("farskip", "farskip_moe") else o + a
        x = rms_norm(moe_in, P[pre + "post_attention_layernorm.weight"], eps)
        s, r, aux, z = moe(x, P, pre + "block_sparse_moe.", cfg, i, B, T, noise)
        o = o + a + s + r
        aux_sum, z_sum = aux_sum + aux, z_sum + z
    logits = rms_norm(o, P["model.norm.weight"], eps) @ P["lm_head.weight"].T
    ce = torch.nn.functional.cross_entropy(logits, targets.reshape(-1))
    loss = ce + cfg["router_aux_loss_coef"] * aux_sum + cfg.get("xdmoe_z_loss_coef", 0.0) * z_sum
    return logits, loss, ce, aux_sum, z_sum


def expected_names(cfg):
    names = ["model.embed_tokens.weight"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names += [p + n for n in ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                  "post_attention_layernorm.weight")]
        names += [p + "block_sparse_moe." + n for n in router_shapes(cfg)]
        for kind, n in (("experts", cfg["num_local_experts"]), ("shared_experts", cfg.get("xdmoe_num_shared_experts", 0))):
            for j in range(n):
                names += [f"{p}block_sparse_moe.{kind}.{j}.{w}.weight" for w in ("w1", "w3", "w2")]
    return names + ["model.norm.weight", "lm_head.weight"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="directory with config.json and model.safetensors")
    ap.add_argument("--batch", required=True, help="safetensors file with `inputs` and `targets` (B, T)")
    ap.add_argument("--out", required=True, help="output safetensors file")
    ap.add_argument("--noise-seed", type=int, help="gshard_noisy_topk router noise: the run's seed")
    ap.add_argument("--noise-step", type=int, help="gshard_noisy_topk router noise: the training step")
    ap.add_argument("--noise-first-row", type=int,
                    help="gshard_noisy_topk router noise: global index of the batch's first sequence")
    args = ap.parse_args()
    torch.set_grad_enabled(True)

    cfg_path = os.path.join(args.checkpoint, "config.json")
    if not os.path.isfile(cfg_path):
        raise ReferenceError(f"{cfg_path}: file not found")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "num_local_experts", "num_experts_per_tok", "rms_norm_eps", "router_aux_loss_coef"):
        if key not in cfg:
            raise ReferenceError(f"{cfg_path}: config key \"{key}\" is missing")
    cfg.setdefault("rope_theta", 10000.0)

    flags = {"--noise-seed": args.noise_seed, "--noise-step": args.noise_step,
             "--noise-first-row": args.noise_first_row}
    given = [f for f, v in flags.items() if v is not None]
    if given and len(given) != len(flags):
        missing = [f for f in flags if f not in given]
        raise ReferenceError(f"{', '.join(given)} given without {', '.join(missing)}: pass all three or none")
    for f in given:
        if not 0 <= flags[f] <= MASK64:
            raise ReferenceError(f"{f} {flags[f]} is outside 0..2^64-1")
    noise = tuple(flags.values()) if given else None

    model_path = os.path.join(args.checkpoint, "model.safetensors")
    raw = read_safetensors(model_path)
    P = {}
    for name in expected_names(cfg):
        if name not in raw:
            raise ReferenceError(f"{model_path}: tensor \"{name}\" is missing")
        P[name] = raw[name].to(torch.float64).requires_grad_(True)
    for i in range(cfg["num_hidden_layers"]):
        for n, shape in router_shapes(cfg).items():
            name = f"model.layers.{i}.block_sparse_moe.{n}"
            if tuple(P[name].shape) != shape:
                raise ReferenceError(f"{model_path}: tensor \"{name}\" has shape {list(P[name].shape)}, "
                                     f"expected {list(shape)} for xdmoe_gating {check_gating(cfg)!r}")

    batch = read_safetensors(args.batch)
    for key in ("inputs", "targets"):
        if key not in batch:
            raise ReferenceError(f"{args.batch}: tensor \"{key}\" is missing")
        if batch[key].dtype not in (torch.int64, torch.int32) or batch[key].dim() != 2:
            raise ReferenceError(f"{args.batch}: tensor \"{key}\" must be I64 or I32 of shape (B, T)")
    inputs, targets = batch["inputs"].long(), batch["targets"].long()
    if inputs.shape != targets.shape:
        raise ReferenceError(f"{args.batch}: inputs {list(inputs.shape)} and targets {list(targets.shape)} differ in shape")

    logits, loss, ce, aux, z = forward(P, cfg, inputs, targets, noise)
    names = list(P)
    grads = torch.autograd.grad(loss, [P[n] for n in names], allow_unused=True)
    out = {"logits": logits.detach().to(torch.float32), "loss": loss.detach(), "ce_loss": ce.detach(),
           "aux_loss": aux.detach(), "z_loss": z.detach()}
    for n, g in zip(names, grads):
        out["grad." + n] = torch.zeros_like(P[n]) if g is None else g
    write_safetensors(args.out, out)


if __name__ == "__main__":
    try:
        main()
    except ReferenceError as e:
        print(f"mixtral_reference.py: error: {e}", file=sys.stderr)
        sys.exit(1)
