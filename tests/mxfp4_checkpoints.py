"""gpt-oss checkpoints in the hub's MXFP4 layout, written from a float one (what the released models hold).

The released gpt-oss checkpoints store every expert projection as OCP MXFP4: 4-bit e2m1 values, two to a byte
(low nibble first), in blocks of 32 along the input dimension, each block with a shared power-of-two scale
stored as an e8m0 byte (exponent + 127). ``gate_up_proj_blocks [experts, 2 * intermediate, hidden / 32, 16]``
and ``gate_up_proj_scales [experts, 2 * intermediate, hidden / 32]`` (rows: the output features, gate and up
interleaved as in the float checkpoint), ``down_proj_blocks / _scales`` likewise; everything else (attention,
router, embeddings, biases) stays in its float dtype. ``quantization_config`` is ``{"quant_method": "mxfp4",
"modules_to_not_convert": [...]}``.

The writer rounds each value to the nearest e2m1 value under its block's scale (the smallest power of two that
brings the block's absmax within 6.0). It is the test's own encoder; the decoder everything is checked against
is transformers' (``transformers.integrations.mxfp4``), which loads these files on the CPU by dequantizing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # codes 0-7; 8-15 are their negatives
MXFP4_BLOCK = 32
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def encode_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., rows, cols]`` float -> (blocks uint8 ``[..., rows, cols / 32, 16]``, scales uint8 ``[..., rows,
    cols / 32]``): e2m1 codes two to a byte, low nibble first, and e8m0 block exponents."""
    *lead, rows, cols = weight.shape
    if cols % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs the input dimension in multiples of {MXFP4_BLOCK} (got {cols})")
    grouped = weight.float().reshape(*lead, rows, cols // MXFP4_BLOCK, MXFP4_BLOCK)
    absmax = grouped.abs().amax(dim=-1, keepdim=True).clamp(min=2.0 ** -126)
    exponent = torch.ceil(torch.log2(absmax / 6.0)).clamp(-127, 127)  # absmax / 2**exponent <= 6
    scaled = grouped / torch.exp2(exponent)
    magnitude_codes = (scaled.abs().unsqueeze(-1) - E2M1_VALUES).abs().argmin(dim=-1)  # nearest of the 8
    codes = (magnitude_codes + 8 * (scaled < 0)).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., rows, groups, 16]
    return packed.contiguous(), (exponent.squeeze(-1) + 127).to(torch.uint8).contiguous()


def write_mxfp4(source: str | Path, target: Path) -> Path:
    """A copy of the float gpt-oss checkpoint at ``source`` with its experts in MXFP4 (transformers' layout)."""
    source, target = Path(source), Path(target)
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            # stored [experts, in, out]; MXFP4 rows are the output features, blocks run along the input
            blocks, scales = encode_mxfp4(tensor.transpose(1, 2))
            out[f"{name}_blocks"], out[f"{name}_scales"] = blocks, scales
        else:
            out[name] = tensor
    save_file(out, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target
