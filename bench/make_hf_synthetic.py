"""Write a random-weight checkpoint in a looped family's own Hugging Face layout, at its real dimensions.

    python bench/make_hf_synthetic.py ouro-1.4b OUT_DIR
    python bench/make_hf_synthetic.py huginn-3.5b OUT_DIR

config.json + model-0000N-of-0000M.safetensors + model.safetensors.index.json, shards of at most
--shard-gb. Tensors are generated and written one at a time (the largest, Huginn's 1.4 GB embedding,
is the peak), so this needs far less memory than the checkpoint. For converter and memory tests only:
the weights are noise (std 0.02 matrices, norms near 1), not a model.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import zlib
from pathlib import Path

import torch

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16"}


def ouro_spec(layers: int = 24) -> tuple[dict, list[tuple[str, tuple[int, ...]]], torch.dtype]:
    d, f, v = 2048, 5632, 49152
    cfg = {
        "architectures": ["OuroForCausalLM"], "model_type": "ouro", "hidden_size": d, "intermediate_size": f,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": layers, "vocab_size": v,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 65536,
        "tie_word_embeddings": False, "total_ut_steps": 4, "early_exit_threshold": 1.0, "hidden_act": "silu",
        "use_sliding_window": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "dtype": "bfloat16",
    }  # fmt: skip
    names: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, d))]
    for i in range(layers):
        p = f"model.layers.{i}"
        names += [(f"{p}.{n}.weight", (d,)) for n in ("input_layernorm", "input_layernorm_2",
                  "post_attention_layernorm", "post_attention_layernorm_2")]  # fmt: skip
        names += [(f"{p}.self_attn.{n}_proj.weight", (d, d)) for n in "qkvo"]
        names += [(f"{p}.mlp.gate_proj.weight", (f, d)), (f"{p}.mlp.up_proj.weight", (f, d))]
        names += [(f"{p}.mlp.down_proj.weight", (d, f))]
    names += [
        ("model.norm.weight", (d,)),
        ("model.early_exit_gate.weight", (1, d)),
        ("model.early_exit_gate.bias", (1,)),
    ]
    names += [("lm_head.weight", (v, d))]
    return cfg, names, torch.bfloat16


def huginn_spec() -> tuple[dict, list[tuple[str, tuple[int, ...]]], torch.dtype]:
    d, h, f, v = 5280, 55, 17920, 65536
    std = math.sqrt(2 / (5 * d))
    cfg = {
        "architectures": ["RavenForCausalLM"], "model_type": "huginn_raven", "n_embd": d, "n_heads": h,
        "num_key_value_heads": h, "intermediate_size": f, "vocab_size": v, "padded_vocab_size": v,
        "n_layers": 8, "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4, "n_layers_in_coda": 2,
        "mean_recurrence": 32, "mean_backprop_depth": 8, "block_size": 4096, "rope_base": 50000.0,
        "norm_eps": 1e-6, "bias": False, "qk_bias": True, "tie_embeddings": True, "init_strategy": "takase",
        "state_init": "like-init", "injection_type": "linear", "norm_class_name": "RMSNorm_llama",
        "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU", "block_class_name": "SandwichBlock",
        "test_time_noise": 0, "init_values": {"std": std, "embed_scale": math.sqrt(d), "embedding": std},
        "dtype": "bfloat16",
    }  # fmt: skip
    names: list[tuple[str, tuple[int, ...]]] = [("transformer.wte.weight", (v, d))]
    for stage, n in (("prelude", 2), ("core_block", 4), ("coda", 2)):
        for i in range(n):
            p = f"transformer.{stage}.{i}"
            names += [(f"{p}.norm_{k}.weight", (d,)) for k in range(1, 5)]
            names += [(f"{p}.attn.Wqkv.weight", (3 * d, d)), (f"{p}.attn.qk_bias", (2, 1, h, d // h))]
            names += [(f"{p}.attn.proj.weight", (d, d)), (f"{p}.mlp.fc.weight", (2 * f, d))]
            names += [(f"{p}.mlp.proj.weight", (d, f))]
    names += [("transformer.adapter.weight", (d, 2 * d)), ("transformer.ln_f.weight", (d,))]
    names += [("lm_head.weight", (v, d)), ("freqs_cis", (1, 4096, 1, d // h // 2, 2))]
    return cfg, names, torch.float32  # the released shards hold fp32


def make_tensor(name: str, shape: tuple[int, ...], cfg: dict) -> torch.Tensor:
    if name == "freqs_cis":
        half, hd = shape[3], 2 * shape[3]
        inv = 1.0 / (cfg["rope_base"] ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(shape[1]).float(), inv)
        return torch.stack((ang.cos(), ang.sin()), dim=-1).view(1, shape[1], 1, half, 2)
    seed_name = "transformer.wte.weight" if name == "lm_head.weight" and "n_embd" in cfg else name  # Huginn: tied copy
    gen = torch.Generator().manual_seed(zlib.crc32(seed_name.encode()))
    t = torch.randn(shape, generator=gen)
    if "norm" in name or name.endswith("ln_f.weight"):
        return t.mul_(0.02).add_(1.0)
    if name.endswith("wte.weight") or name == "lm_head.weight" and "n_embd" in cfg:
        return t.mul_(cfg["init_values"]["std"])
    return t.mul_(0.02)


def write(kind: str, out: Path, shard_gb: float) -> None:
    cfg, names, dtype = ouro_spec() if kind == "ouro-1.4b" else huginn_spec()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen_cfg = (
        {"bos_token_id": 1, "eos_token_id": 2}
        if kind == "ouro-1.4b"
        else {"bos_token_id": 65504, "eos_token_id": [65505, 65508]}
    )
    (out / "generation_config.json").write_text(json.dumps(gen_cfg))
    size = torch.empty((), dtype=dtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for name, shape in names:
        nbytes = math.prod(shape) * size
        if shards[-1] and used + nbytes > shard_gb * 1e9:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, pos = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in shard:
            n = math.prod(shape) * size
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
            pos += n
            weight_map[name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name, shape in shard:
                t = make_tensor(name, shape, cfg).to(dtype).contiguous()
                f.write(t.view(-1).view(torch.uint8).numpy().tobytes())
                del t
        print(f"wrote {fname} ({pos / 1e9:.2f} GB, {len(shard)} tensors)", flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=("ouro-1.4b", "huginn-3.5b"))
    p.add_argument("out", type=Path)
    p.add_argument("--shard-gb", type=float, default=4.8)
    args = p.parse_args()
    write(args.kind, args.out, args.shard_gb)


if __name__ == "__main__":
    main()
