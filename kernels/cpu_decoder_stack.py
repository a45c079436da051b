"""A bf16 Llama-family or Gemma 3 model's decoder layers in one native call per step
(``kernels/native/decoder_stack.h``).

Layer by layer, a step calls about a dozen kernels per layer from Python (norm, q/k/v GEMM, rotary, KV store,
attention, o GEMM, norm, gate/up GEMM, SiLU, down GEMM), each wrapper checking its tensors, allocating its output
and crossing into C. Where every layer is exactly Llama's (``LlamaFamilyForCausalLM.plain_decoder_layers``:
RMSNorms, attention without sinks and with Qwen3's q/k RMSNorms or none, the dense SiLU MLP, no hooks such as tensor
parallelism's all-reduces) and each of its linears runs a native GEMM for the step's row count (the bf16 panel GEMM,
or a W8A8 layer's packed int8 GEMM after its activation codes), the step's layers run in one call instead: the
same kernels with the same arguments and thread counts, so the same bits (the tests compare them), with the host's
part once per step. Gemma 3's layers (``decoder_layer_form`` "gemma3": offset norms, two more of them a layer, q/k
norms, GELU-tanh, each layer's window, RoPE cache and attention scale) run the same way. Measured on Zen 4, bf16,
the 512x8 model, one thread: a batch-1 decode step 3.78 -> 1.82 ms, batch 48 16.5 -> 15.3 ms; the 1.1B shape in
W8A8, two threads, batch 1 40.8 -> 25.3 ms; a Gemma-3-1B shape, batch 8, two threads, 52-58 -> 45-46 ms
(docs/cpu-kernels.md); on a CPU whose GEMMs are faster (AMX) the host's share of a step is larger still.

The plan (the weights' and caches' addresses, the shapes) is built once per KV cache; each step passes its
batch's tensors. ``TANDEM_CPU_DECODER_STACK=0`` turns it off (the layer-by-layer path, for A/B runs).
"""

from __future__ import annotations

import logging
import os

import torch

from kernels import cpu_int8, cpu_moe, cpu_native
from kernels.cpu_gemm import CpuLinear
from kernels.cpu_paged_attention import NATIVE_MAX_GROUP, NATIVE_MAX_HEAD_DIM, may_route_to_flash

logger = logging.getLogger(__name__)

SWITCH_ENV = "TANDEM_CPU_DECODER_STACK"


def is_turned_on() -> bool:
    raw = os.environ.get(SWITCH_ENV, "1").strip().lower()
    if raw not in ("0", "1", "false", "true", "off", "on", "no", "yes"):
        raise ValueError(f"{SWITCH_ENV}={raw!r}: use 1 (one native call per step where it applies) or 0")
    return raw in ("1", "true", "on", "yes")


class StackLinear:
    """One linear layer as the plan describes it (``LINEAR_FIELDS`` in decoder_stack.h): the bf16 panel GEMM's copy of
    a ``CpuLinear``, or an ``Int8Linear``'s packed W8A8 weight; and the batches it takes in one call, those its own
    call would send to the same kernel."""

    def __init__(self, gemm: CpuLinear | None = None, int8=None):
        self.gemm, self.int8 = gemm, int8  # int8: the layer's Int8Matrix (pipeline/quantization/int8.py)
        if gemm is not None:
            self.in_features, self.out_features = gemm.panels.in_features, gemm.out_features
            self.held = [t for t in (gemm.panels.packed, gemm.panel_bias) if t is not None]
            self.fields = [0, gemm.panels.packed.data_ptr(), 0, 0,
                           0 if gemm.panel_bias is None else gemm.panel_bias.data_ptr(), 0, 0]
            self.codes_per_row = 0
        else:
            packed, static_scale = int8.packed, int8.act_scale
            self.in_features, self.out_features = packed.in_features, packed.out_features
            self.held = [t for t in (packed.packed, packed.correction, packed.scale, packed.bias, static_scale)
                         if t is not None]
            self.fields = [1, packed.packed.data_ptr(), packed.correction.data_ptr(), packed.scale.data_ptr(),
                           0 if packed.bias is None else packed.bias.data_ptr(), packed.packed.shape[1],
                           0 if static_scale is None else static_scale.data_ptr()]
            self.codes_per_row = 4 * packed.packed.shape[1]

    @classmethod
    def of(cls, module: torch.nn.Module) -> StackLinear | None:
        """The module's linear as the stack runs it; None where it runs neither kernel (oneDNN alone, torch._int_mm
        or the torch code for int8)."""
        gemm = getattr(module, "gemm", None)
        if isinstance(gemm, CpuLinear):
            return cls(gemm=gemm) if gemm.panels is not None else None
        matrix = getattr(module, "matrix", None)
        is_packed_int8 = (matrix is not None and getattr(module, "dtype", None) == torch.bfloat16
                          and getattr(matrix, "is_native", False)
                          and isinstance(getattr(matrix, "packed", None), cpu_int8.PackedInt8Weight)
                          and (matrix.act_scale is None or matrix.act_scale.dtype == torch.float32))
        return cls(int8=matrix) if is_packed_int8 else None

    def takes(self, rows: int) -> bool:
        if self.gemm is not None:
            return self.gemm.takes_panels(rows)
        return cpu_int8.packed_gemm_preferred(rows)

    @property
    def route(self) -> tuple:
        """What ``takes`` depends on besides the row count: linears with the same route answer alike."""
        return ("int8",) if self.gemm is None else ("panels", self.gemm.packed is None)


class NativeDecoderStack:
    """One step of a model's decoder layers in one native call: ``(embedded, batch, kv_cache) -> (delta,
    residual)``, what the layer-by-layer loop leaves for the final norm. Build it with ``for_model``."""

    def __init__(self, model: torch.nn.Module, layers: list, linears: list[list[StackLinear]], form: str):
        attention = layers[0].self_attn
        self.num_layers = len(layers)
        self.shape = dict(hidden=linears[0][0].in_features, q_heads=attention.num_q_heads,
                          kv_heads=attention.num_kv_heads, head_dim=attention.head_dim,
                          intermediate=linears[0][3].in_features)
        self.linears = [linear for layer in linears for linear in layer]
        # one linear per route asks for a step's row count (all of a model's panel linears hold the same copies)
        self._route_askers = list({linear.route: linear for linear in self.linears}.values())
        self.max_codes = max(linear.codes_per_row for linear in self.linears)
        self.has_qk_norm = attention.has_qk_norm
        self.is_gemma = form == "gemma3"
        qk_norms = [_qk_norms(layer) for layer in layers]
        ff_norms = [_ff_norms(layer, form) for layer in layers]
        # every tensor the plan points at, held here so that none is freed while the plan lives
        self._held = [tensor for index, layer in enumerate(layers) for tensor in (
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight, model.cos_sin_cache_of(index),
            *(norm.weight for norm in qk_norms[index] + ff_norms[index]))] + [
            t for linear in self.linears for t in linear.held]
        # each layer's plan fields (decoder_stack.h's LAYER_*) before and after its K and V caches' addresses
        self._fields_around_kv = [
            ([layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
              model.cos_sin_cache_of(index).data_ptr()],
             [layer.self_attn.sliding_window or 0, *([norm.weight.data_ptr() for norm in qk_norms[index]] or [0, 0]),
              *([norm.weight.data_ptr() for norm in ff_norms[index]] or [0, 0]),
              *(field for linear in linears[index] for field in linear.fields)])
            for index, layer in enumerate(layers)]
        self.floats = torch.tensor([[layer.input_layernorm.eps, layer.post_attention_layernorm.eps,
                                     layer.self_attn.scale, *([norm.eps for norm in qk_norms[index]] or [0.0, 0.0]),
                                     *([norm.eps for norm in ff_norms[index]] or [0.0, 0.0])]
                                    for index, layer in enumerate(layers)], dtype=torch.float64)
        self._plan: torch.Tensor | None = None
        self._plan_key: tuple | None = None
        self.scratch_per_row = 0

    def takes(self, batch) -> bool:
        """Whether this step may run in one call: every row leaves the last layer (no ``final_layer``), each linear
        runs the kernel it would run on its own for this many rows (the panel GEMM, the packed int8 GEMM), no
        sequence goes to torch's flash attention, and the batch's tensors are laid out as the native kernels read
        them."""
        rows, num_seqs = batch.num_tokens, batch.num_seqs
        longest_possible = rows - num_seqs + 1  # query rows of one sequence, at most (a decode batch: 1)
        return (rows > 0 and batch.final_layer is None and batch.query_rows is None
                and not may_route_to_flash(longest_possible, torch.bfloat16)
                and all(linear.takes(rows) for linear in self._route_askers)
                and _is_flat(batch.positions, torch.int64) and _is_flat(batch.slot_mapping, torch.int64)
                and _is_flat(batch.cu_seqlens_q, torch.int32) and _is_flat(batch.context_lens, torch.int32)
                and batch.block_tables.dtype == torch.int32 and batch.block_tables.dim() == 2
                and batch.block_tables.stride(-1) == 1)

    def __call__(self, embedded: torch.Tensor, batch, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``embedded`` ``[rows, hidden]`` bf16 through every layer, each writing its K/V into ``kv_cache``
        (``[num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim]``): (the last layer's output, the running
        sum before it)."""
        plan = self._plan_for(kv_cache)
        embedded = embedded if embedded.is_contiguous() else embedded.contiguous()
        rows = embedded.shape[0]
        delta, residual = torch.empty_like(embedded), torch.empty_like(embedded)
        scratch = torch.empty(rows * self.scratch_per_row, dtype=torch.bfloat16)
        cpu_native.ops.decoder_stack(
            plan.data_ptr(), self.floats.data_ptr(), embedded.data_ptr(), delta.data_ptr(), residual.data_ptr(),
            scratch.data_ptr(), scratch.numel(), batch.positions.data_ptr(), batch.slot_mapping.data_ptr(),
            batch.cu_seqlens_q.data_ptr(), batch.context_lens.data_ptr(), batch.block_tables.data_ptr(),
            batch.block_tables.stride(0), rows, batch.context_lens.numel(), torch.get_num_threads())
        return delta, residual

    def _plan_for(self, kv_cache: torch.Tensor) -> torch.Tensor:
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.stride())
        if key != self._plan_key:
            self._plan, self._plan_key = self._build_plan(kv_cache), key
            self.scratch_per_row = cpu_native.ops.decoder_stack_scratch(self._plan.data_ptr())
        return self._plan

    def _build_plan(self, kv_cache: torch.Tensor) -> torch.Tensor:
        shape = self.shape
        expected = (self.num_layers, 2, shape["kv_heads"], shape["head_dim"])
        if (kv_cache.dtype != torch.bfloat16 or kv_cache.dim() != 6 or kv_cache.shape[0] < self.num_layers
                or (kv_cache.shape[1], *kv_cache.shape[-2:]) != expected[1:] or kv_cache.stride(-1) != 1
                or kv_cache.stride(-2) != shape["head_dim"]):
            raise ValueError(f"decoder stack: a KV cache of shape {tuple(kv_cache.shape)} and strides "
                             f"{kv_cache.stride()} is not laid out as this model's layers write it")
        layer_stride, half_stride, block_stride, token_stride = kv_cache.stride()[:4]
        header = [shape["hidden"], shape["q_heads"], shape["kv_heads"], shape["head_dim"], shape["intermediate"],
                  kv_cache.shape[3], block_stride, token_stride, block_stride, token_stride, self.num_layers,
                  int(self.has_qk_norm), self.max_codes, int(self.is_gemma)]
        base, size = kv_cache.data_ptr(), kv_cache.element_size()
        layers = [[*before, base + index * layer_stride * size, base + (index * layer_stride + half_stride) * size,
                   *after] for index, (before, after) in enumerate(self._fields_around_kv)]
        return torch.tensor(header + [field for layer in layers for field in layer], dtype=torch.int64)


def _is_flat(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return tensor.dtype == dtype and tensor.is_contiguous()


def _qk_norms(layer) -> tuple:
    """The layer's per-head q and k norms (Qwen3's, Gemma's), or none."""
    attention = layer.self_attn
    return (attention.q_norm, attention.k_norm) if attention.has_qk_norm else ()


def _ff_norms(layer, form: str) -> tuple:
    """Gemma's norms around the MLP (before it, with the residual, and after it), or none (Llama's layers)."""
    return (layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm) if form == "gemma3" else ()


def for_model(model: torch.nn.Module) -> NativeDecoderStack | None:
    """The model's decoder layers as one native call, where they are all Llama's (or Gemma 3's) plain ones in bf16
    with every linear on the panel GEMM or the packed int8 one (its native body available here) and shapes the
    kernels take; else None."""
    if not is_turned_on() or cpu_native.ops is None:
        return None
    plain = getattr(model, "plain_decoder_layers", None)
    layers = plain() if plain is not None else None
    form = getattr(model, "decoder_layer_form", None)
    if not layers or getattr(model, "dtype", None) != torch.bfloat16 or form not in ("llama", "gemma3"):
        return None
    linears = [[StackLinear.of(module) for module in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        for layer in layers]
    uses_panels = any(linear is not None and linear.gemm is not None for layer in linears for linear in layer)
    if any(linear is None for layer in linears for linear in layer) or (uses_panels
                                                                        and not cpu_moe.native_available()):
        return None
    attention = layers[0].self_attn
    q_heads, kv_heads, head_dim = attention.num_q_heads, attention.num_kv_heads, attention.head_dim
    hidden, intermediate = linears[0][0].in_features, linears[0][3].in_features
    widths = (hidden, (q_heads + 2 * kv_heads) * head_dim, q_heads * head_dim, hidden, hidden, 2 * intermediate,
              intermediate, hidden)  # (in, out) of q/k/v, o, gate/up, down
    same_shapes = all(
        (layer.self_attn.num_q_heads, layer.self_attn.num_kv_heads, layer.self_attn.head_dim) == (
            q_heads, kv_heads, head_dim)
        and tuple(w for linear in layer_linears for w in (linear.in_features, linear.out_features)) == widths
        for layer, layer_linears in zip(layers, linears))
    cos_sin_ok = all(model.cos_sin_cache_of(index).dtype == torch.float32
                     and model.cos_sin_cache_of(index).is_contiguous()
                     and model.cos_sin_cache_of(index).shape[-1] == head_dim for index in range(len(layers)))
    has_qk_norm = attention.has_qk_norm
    norms = [norm for layer in layers for norm in (
        layer.input_layernorm, layer.post_attention_layernorm, *_qk_norms(layer), *_ff_norms(layer, form))]
    norms_ok = all(layer.self_attn.has_qk_norm == has_qk_norm for layer in layers) and all(
        norm.weight.dtype == torch.bfloat16 and norm.weight.is_contiguous() and norm.weight.device.type == "cpu"
        for norm in norms) and (not has_qk_norm or all(
            layer.self_attn.q_norm.weight.numel() == head_dim == layer.self_attn.k_norm.weight.numel()
            for layer in layers))
    kernels_take = (kv_heads > 0 and q_heads % kv_heads == 0 and q_heads // kv_heads <= NATIVE_MAX_GROUP
                    and head_dim <= NATIVE_MAX_HEAD_DIM and head_dim % 2 == 0)
    if not (same_shapes and cos_sin_ok and norms_ok and kernels_take):
        return None
    kinds = sorted({"int8 GEMM" if linear.int8 is not None else "panel GEMM" for layer in linears for linear in layer})
    logger.info("decoder layers: one native call per step for batches on the %s (%d %s layers)", " and ".join(kinds),
                len(layers), form)
    return NativeDecoderStack(model, layers, linears, form)
