"""OCP MXFP4 weights (gpt-oss's released experts) back to floats at load.

Each expert projection is stored as ``<name>_blocks`` uint8 ``[experts, out, in / 32, 16]`` — 4-bit e2m1 codes,
two to a byte, the low nibble first — and ``<name>_scales`` uint8 ``[experts, out, in / 32]``: one e8m0
exponent (biased by 127) per block of 32 inputs. A value is ``E2M1[code] * 2 ** (scale - 127)``; e2m1 values
times a power of two are exact in fp32 and bf16, so dequantizing loses nothing. The result is laid out as the
float checkpoint's tensor of the same name (``[experts, in, out]``), which the model then loads as usual.
Memory: the experts take the model dtype's size (4x MXFP4's in bf16); there is no MXFP4 expert kernel here.
"""

from __future__ import annotations

import torch

from pipeline.checkpoint_errors import CheckpointError

BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
GROUP_SIZE = 32  # inputs per block, sharing one scale
# e2m1 codes 0-15: sign bit 3, then two exponent bits and one mantissa bit
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127


def dequantize_mxfp4(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``[experts, in, out]`` (the float checkpoint's layout of ``name``) from its MXFP4 blocks and scales."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"{name}: MXFP4 blocks and scales are uint8 (got {blocks.dtype}, {scales.dtype})")
    if blocks.dim() != 4 or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(f"{name}{BLOCKS_SUFFIX} {tuple(blocks.shape)} and {name}{SCALES_SUFFIX} "
                              f"{tuple(scales.shape)} do not form MXFP4 blocks ([experts, out, groups, 16] and "
                              "[experts, out, groups])")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)  # [e, out, g, 16, 2]
    values = values.flatten(-2) * torch.exp2(scales.float() - E8M0_BIAS).unsqueeze(-1)  # [e, out, g, 32]
    experts, out_features = blocks.shape[:2]
    return values.reshape(experts, out_features, -1).transpose(1, 2).contiguous()  # [experts, in, out]


class Mxfp4Pairs:
    """Pairs each expert tensor's blocks with its scales as the checkpoint's stream brings them (either first)."""

    def __init__(self):
        self._halves: dict[str, dict[str, torch.Tensor]] = {}  # tensor name -> the half (suffix) seen so far

    @staticmethod
    def holds(name: str) -> bool:
        return name.endswith((BLOCKS_SUFFIX, SCALES_SUFFIX))

    def add(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """The dequantized tensor once both halves of ``name``'s tensor are in; None until then."""
        base, suffix = name[:-len(BLOCKS_SUFFIX)], name[-len(BLOCKS_SUFFIX):]  # both suffixes are 7 characters
        halves = self._halves.setdefault(base, {})
        halves[suffix] = tensor
        if len(halves) < 2:
            return None
        del self._halves[base]
        return base, dequantize_mxfp4(base, halves[BLOCKS_SUFFIX], halves[SCALES_SUFFIX])

    def check_complete(self) -> None:
        """At the end of the stream: a blocks tensor without its scales (or the reverse) is named."""
        if self._halves:
            base, halves = next(iter(self._halves.items()))
            have = next(iter(halves))
            lacking = SCALES_SUFFIX if have == BLOCKS_SUFFIX else BLOCKS_SUFFIX
            raise CheckpointError(f"the checkpoint has {base}{have} but no {base}{lacking}")
