"""The CPU kernel set, for ``load_kernels("cpu")`` (and "auto" on a CPU device): the native kernels of
``kernels/native`` where they apply, the torch references for every other op and wherever a native
kernel does not take its inputs (so the set is always complete, built or not), and linear layers on
oneDNN with packed weights (``kernels/cpu_gemm.py``). A mixture-of-experts MLP's stacked experts get a
``CpuLinear`` pair per expert the same way, run over the tokens grouped by expert as the reference groups them
(``kernels/moe_ref.py``): one packed GEMM pair per expert; in bf16 on an AVX512-BF16 CPU, all experts' GEMMs in
one native call each instead wherever no expert has more rows than ``kernels/cpu_moe.py`` takes (decode, and on a
CPU without AMX prefill too). On an AMX CPU a bf16 model's prompt chunks from a row count measured at load run
torch's flash attention (``kernels/cpu_prompt_route.py``), and int8 batches from a measured row count take
oneDNN's AMX kernels (``kernels/cpu_int8_route.py``); bf16 linears keep the native panel copy beside oneDNN's for
the decode batches it measures faster on (``kernels/cpu_bf16_route.py``). Gemma's offset RMSNorm and GELU-tanh
gated activation run the same native kernels as Llama's norm and SiLU, each switched to Gemma's form."""

from __future__ import annotations

from dataclasses import replace

import torch

from kernels import cpu_bf16_route, cpu_decoder_stack, cpu_int8, cpu_int8_route, cpu_moe, cpu_native, cpu_prompt_route
from kernels.cpu_gemm import PACKED_MAX_ROWS, CpuLinear, describe_bf16_route
from kernels.cpu_elementwise import (apply_rotary_cpu, clamped_swiglu_cpu, gelu_tanh_and_mul_cpu, offset_rms_norm_cpu,
                                     rms_norm_cpu, silu_and_mul_cpu, store_kv_cpu)
from kernels.cpu_mla_attention import AbsorbedProducts, mla_attention_cpu
from kernels.cpu_paged_attention import describe_prompt_route, paged_attention_cpu


def cpu_kernels(torch_kernels, model_dtype: torch.dtype | None = None, latent_attention: bool = False):
    """``torch_kernels`` with the native CPU kernels in their places; named for a model of ``model_dtype`` (with
    latent attention, DeepSeek's MLA, whose prompt chunks never take the AMX flash route) when given."""
    cpu_native.check_switch()
    runs_native = cpu_native.ops is not None and model_dtype in (None, *cpu_native.NATIVE_DTYPES)
    bf16_route = describe_bf16_route() if runs_native else None  # checks TANDEM_CPU_BF16_GEMM for every model
    routes = [bf16_route if model_dtype in (None, torch.bfloat16) else None,
              ("latent attention native" if latent_attention else describe_prompt_route()),
              cpu_int8.describe_amx_route()] if runs_native else []
    return replace(
        torch_kernels, name=", ".join([f"cpu: {cpu_native.describe(model_dtype)}", *(r for r in routes if r)]),
        paged_attention=paged_attention_cpu, mla_attention=mla_attention_cpu,
        rms_norm=rms_norm_cpu, apply_rotary=apply_rotary_cpu, store_kv=store_kv_cpu, silu_and_mul=silu_and_mul_cpu,
        offset_rms_norm=offset_rms_norm_cpu, gelu_tanh_and_mul=gelu_tanh_and_mul_cpu, clamped_swiglu=clamped_swiglu_cpu,
        prepare_model=prepare_model_cpu, combine_grouped_rows=cpu_moe.combine_grouped_rows_cpu,
    )


def prepare_model_cpu(model: torch.nn.Module, prepack_weights: bool = True) -> None:
    """Give every linear layer of a CPU model (and its output projection) a ``CpuLinear``. Idempotent.

    A layer whose GEMM no longer reads its parameter (packed on an AVX-512 CPU, or widened to fp32) lets the
    parameter go: it keeps its shape and dtype on the meta device, so the weights are held once. So do a
    mixture-of-experts layer's stacked experts where the one-call grouped GEMM takes every group. A weight its
    parent reads itself (``weights_read_directly``: MLA's ``kv_b_proj``) gets no GEMM and keeps its parameter.
    """
    if getattr(model, "is_prepared_for_cpu", False):
        return
    read_directly = {id(getattr(parent, leaf)) for parent in model.modules()
                     for leaf in getattr(parent, "weights_read_directly", ())}
    # on an AMX CPU, bf16 linears may also keep the native panel copy for decode batches (measured below)
    panels_beside = prepack_weights and cpu_bf16_route.panels_fit(model)
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (hasattr(module, "gemm") and weight is not None and weight.device.type == "cpu"
                and id(module) not in read_directly):
            module.gemm = CpuLinear(weight.detach(), None if module.bias is None else module.bias.detach(),
                                    prepack=prepack_weights, panels_beside_onednn=panels_beside)
            if not module.gemm.holds(weight):
                _let_go(module, "weight")
        elif hasattr(module, "gate_up_proj_bias") and hasattr(module, "grouped_experts") and (
                module.gate_up_proj.device.type == "cpu"):
            # gpt-oss's biased experts: packed once for the one-call path where it runs (bf16); where it takes every
            # group (no AMX) nothing reads the stacked weights, else the groups it declines run the per-expert loop
            if prepack_weights and module.gate_up_proj.dtype == torch.bfloat16 and cpu_moe.native_available():
                module.grouped_experts = cpu_moe.GroupedExperts(
                    module.gate_up_proj.detach(), module.down_proj.detach(), module.gate_up_proj_bias.detach(),
                    module.down_proj_bias.detach())
                if cpu_moe.MAX_ROWS_PER_EXPERT is None:
                    _let_go(module, "gate_up_proj")
                    _let_go(module, "down_proj")
        elif hasattr(module, "absorbed_products") and module.kv_b_proj.weight.device.type == "cpu":
            # MLA's per-head products with kv_b_proj (read directly, so no GEMM above): on the grouped GEMM in bf16
            if prepack_weights and module.kv_b_proj.weight.dtype == torch.bfloat16 and cpu_moe.native_available():
                module.absorbed_products = AbsorbedProducts(*(w.detach() for w in module.absorbed_weights()))
        elif hasattr(module, "expert_gemms") and module.gate_up_proj.device.type == "cpu":
            # a mixture-of-experts layer's stacked experts: all of them packed once for the one-call path
            # (kernels/cpu_moe.py) where it runs, and each expert's pair of GEMMs packed like a linear's for the
            # groups it does not take; where it takes every group oneDNN's packed rows would serve (up to
            # PACKED_MAX_ROWS), those copies would never be read, and are not made (the experts are held twice, not
            # three times)
            grouped = (prepack_weights and module.gate_up_proj.dtype == torch.bfloat16
                       and cpu_moe.native_available())
            if grouped:
                module.grouped_experts = cpu_moe.GroupedExperts(module.gate_up_proj.detach(),
                                                                module.down_proj.detach())
                if cpu_moe.MAX_ROWS_PER_EXPERT is None:  # it takes every group: nothing reads the stacked experts
                    module.expert_gemms = None
                    _let_go(module, "gate_up_proj")
                    _let_go(module, "down_proj")
                    continue
            takes_every_packed_group = cpu_moe.MAX_ROWS_PER_EXPERT is None or (
                PACKED_MAX_ROWS is not None and cpu_moe.MAX_ROWS_PER_EXPERT >= PACKED_MAX_ROWS)
            pack_each = prepack_weights and not (grouped and takes_every_packed_group)
            module.expert_gemms = [
                (CpuLinear(gate_up.detach(), None, prepack=pack_each), CpuLinear(down.detach(), None,
                                                                                  prepack=pack_each))
                for gate_up, down in zip(module.gate_up_proj, module.down_proj)]
    if hasattr(model, "logits_gemm") and hasattr(model, "output_weight"):
        lm_head = getattr(model, "lm_head", None)
        model.logits_gemm = lm_head.gemm if lm_head is not None and lm_head.gemm is not None else CpuLinear(
            model.output_weight().detach(), None, prepack=prepack_weights, panels_beside_onednn=panels_beside)
    model.is_prepared_for_cpu = True
    # on an AMX CPU, measured once: from how many rows bf16 prompt attention goes to torch's flash path, int8
    # batches to torch._int_mm, and bf16 linears' batches from the panel GEMM to oneDNN
    cpu_prompt_route.calibrate_for_model(model)
    cpu_int8_route.calibrate_for_model(model)
    if panels_beside:  # only then does a layer hold both copies to route between
        cpu_bf16_route.calibrate_for_model(model)
    if hasattr(model, "native_decoder_stack"):  # once the routes are set and every unread copy let go
        model.native_decoder_stack = cpu_decoder_stack.for_model(model)


def _let_go(module: torch.nn.Module, name: str) -> None:
    """Free a parameter nothing reads any more: it keeps its shape and dtype, on the meta device."""
    meta = torch.empty_like(getattr(module, name), device="meta")
    setattr(module, name, torch.nn.Parameter(meta, requires_grad=False))
