#!/usr/bin/env python3
"""Independent PyTorch re-implementation of the xdmoe forward pass (docs/model.md).

Written from the spec, not from the C++ model, so tests/model_torch_reference_test.cc can
cross-check the hand-written forward and backward. Needs only the Python standard
library and torch; safetensors files are read and written by hand.

  mixtral_reference.py --checkpoint DIR --batch BATCH.safetensors --out OUT.safetensors

DIR holds config.json and model.safetensors (an xdmoe checkpoint). BATCH holds I64
or I32 tensors `inputs` and `targets` of shape (B, T). Everything is computed in
float64. OUT receives `logits` (B*T, V) F32, the F64 scalars `loss` (ce + aux_coef *
sum aux + z_coef * sum z), `ce_loss`, `aux_loss`, `z_loss` (the last two summed over
layers, before their coefficients), and `grad.<name>` (F64) for every parameter: the
gradient of `loss`.
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


def moe(x, P, pre, cfg):
    """Returns (shared, routed, aux, z) for the normed input x (N, d)."""
    N = x.shape[0]
    E, k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    gating = cfg.get("xdmoe_gating", "softmax_topk")
    shared = torch.zeros_like(x)
    for j in range(cfg.get("xdmoe_num_shared_experts", 0)):
        shared = shared + swiglu(x, P, f"{pre}shared_experts.{j}.")
    logits = x @ P[pre + "gate.weight"].T  # (N, E)
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
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
    elif gating == "expert_choice":
        p = logits.softmax(-1)
        idx = torch.sort(p.detach(), dim=0, descending=True, stable=True).indices[:C, :]  # (C, E)
        chosen = torch.zeros(N, E, dtype=torch.bool).scatter_(0, idx, True)
        W = torch.where(chosen, p, W)
        aux = torch.zeros((), dtype=x.dtype)
    else:
        raise ReferenceError(f"config key \"xdmoe_gating\": unknown gating {gating!r}")
    # Dense evaluation: W is 0 where a token has no (kept) assignment to e.
    routed = sum(W[:, e:e + 1] * swiglu(x, P, f"{pre}experts.{e}.") for e in range(E))
    return shared, routed, aux, z


def forward(P, cfg, inputs, targets):
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
        s, r, aux, z = moe(x, P, pre + "block_sparse_moe.", cfg)
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
                                  "post_attention_layernorm.weight", "block_sparse_moe.gate.weight")]
        for kind, n in (("experts", cfg["num_local_experts"]), ("shared_experts", cfg.get("xdmoe_num_shared_experts", 0))):
            for j in range(n):
                names += [f"{p}block_sparse_moe.{kind}.{j}.{w}.weight" for w in ("w1", "w3", "w2")]
    return names + ["model.norm.weight", "lm_head.weight"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="directory with config.json and model.safetensors")
    ap.add_argument("--batch", required=True, help="safetensors file with `inputs` and `targets` (B, T)")
    ap.add_argument("--out", required=True, help="output safetensors file")
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

    model_path = os.path.join(args.checkpoint, "model.safetensors")
    raw = read_safetensors(model_path)
    P = {}
    for name in expected_names(cfg):
        if name not in raw:
            raise ReferenceError(f"{model_path}: tensor \"{name}\" is missing")
        P[name] = raw[name].to(torch.float64).requires_grad_(True)

    batch = read_safetensors(args.batch)
    for key in ("inputs", "targets"):
        if key not in batch:
            raise ReferenceError(f"{args.batch}: tensor \"{key}\" is missing")
        if batch[key].dtype not in (torch.int64, torch.int32) or batch[key].dim() != 2:
            raise ReferenceError(f"{args.batch}: tensor \"{key}\" must be I64 or I32 of shape (B, T)")
    inputs, targets = batch["inputs"].long(), batch["targets"].long()
    if inputs.shape != targets.shape:
        raise ReferenceError(f"{args.batch}: inputs {list(inputs.shape)} and targets {list(targets.shape)} differ in shape")

    logits, loss, ce, aux, z = forward(P, cfg, inputs, targets)
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
