"""Block-wise FP8 checkpoints made from a saved Hugging Face folder, as DeepSeek-V3's and the Qwen3 ``-FP8`` models'
are published: every linear layer's weight (not the LM head, embeddings, norms or routers) as ``float8_e4m3fn`` with a
float32 ``weight_scale_inv`` per block of rows and columns (the ceiling grid), and ``quantization_config`` in
``config.json``. What titanium's FP8 reader is tested on (no hub)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

QUANTIZED = ("_proj.weight", "_proj_with_mqa.weight")
"""The names of the linear layers' weights (HF's ``q_proj``... and DeepSeek's ``kv_a_proj_with_mqa``)."""


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8 weight, float32 scales)``: each block of ``block`` rows x columns (the last ones partial) scaled so
    its largest magnitude is float8_e4m3fn's largest."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = weight.new_zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :cols] = weight
    blocks = padded.view(grid[0], block[0], grid[1], block[1])
    scales = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    quantized = (blocks / scales[:, None, :, None]).to(torch.float8_e4m3fn).view_as(padded)
    return quantized[:rows, :cols].contiguous(), scales.float()


def dequantized(weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The weight a quantized one stands for: each element times its block's scale."""
    rows, cols = weight.shape
    expanded = scales.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * expanded


def quantize_folder(folder: Path, block: tuple[int, int]) -> None:
    """Rewrite the HF checkpoint in ``folder`` (one file or sharded with an index) in block-wise FP8, in place."""
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    for name in files:
        tensors = {}
        for key, value in load_file(folder / name).items():
            if key.endswith(QUANTIZED) and value.dim() == 2:
                scale_key = f"{key}_scale_inv"
                tensors[key], tensors[scale_key] = quantize_blocks(value.float(), block)
                if index:
                    index["weight_map"][scale_key] = name
            else:
                tensors[key] = value
        save_file(tensors, folder / name, metadata={"format": "pt"})
    if index:
        index_path.write_text(json.dumps(index, indent=2))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, scales)`` of an MoE's stacked expert weight ``[experts, in, out]`` as GPT-OSS's checkpoints store it:
    by output, 32 inputs a group, each value the FP4 E2M1 nearest to it over the group's power of two (the smallest
    that brings the group's largest magnitude to 6 or less), two per byte (the low nibble first)."""
    from titanium.checkpoint.hf_quantized import FP4_VALUES

    by_output = weight.transpose(1, 2)
    experts, outputs, inputs = by_output.shape
    groups = by_output.reshape(experts, outputs, inputs // 32, 32)
    exponents = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    nibbles = ((groups / torch.exp2(exponents)[..., None])[..., None] - torch.tensor(FP4_VALUES)).abs().argmin(-1)
    blocks = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).to(torch.uint8)
    return blocks.contiguous(), (exponents + 127).to(torch.uint8)


def quantize_experts_mxfp4(folder: Path) -> None:
    """Rewrite a one-file GPT-OSS checkpoint's stacked expert weights (``gate_up_proj``, ``down_proj``) in MXFP4, as
    its published checkpoints hold them, in place."""
    tensors = {}
    for key, value in load_file(folder / "model.safetensors").items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = quantize_mxfp4(value.float())
        else:
            tensors[key] = value
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    skipped = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": skipped}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
