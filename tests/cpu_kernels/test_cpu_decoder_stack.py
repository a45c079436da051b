"""``kernels/cpu_decoder_stack.py``: a bf16 Llama-family or Gemma 3 model's decoder layers in one native call per
step give the same bits as the layer-by-layer path (tokens and logprobs through the real engine, decode and mixed
steps, GQA, sliding windows, Qwen2's biased q/k/v, Qwen3's q/k norms, Gemma 3's local and global layers, W8A8, one
and two threads), only where every layer is plain Llama or Gemma 3 on the panel GEMM, and only for the batches it
takes. Where this CPU has no AVX512-BF16 the panel
GEMM's portable body runs it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import cpu_decoder_stack, cpu_gemm, cpu_int8, cpu_int8_route, cpu_native, cpu_paged_attention
from pipeline import LLM, SamplingParams
from pipeline.builtin_model import build_checkpoint
from pipeline.forward_batch import ForwardBatch
from tests.conftest import TINY_CONFIGS
from tests.gemma_checkpoints import gemma3_checkpoint  # noqa: F401 (a fixture)
from tests.gpt_oss_checkpoints import gpt_oss_checkpoint  # noqa: F401 (a fixture)
from tests.quantized_checkpoints import quantized_checkpoint  # noqa: F401 (a fixture)


@pytest.fixture(autouse=True)
def routes_fixed(monkeypatch):
    """No prompt chunk to torch's flash attention and every int8 batch on the packed GEMM, as on a CPU without AMX:
    on an AMX CPU the load-time measurements could send some of the tests' chunks layer by layer (still the same
    bits), and the stack would see fewer of them."""
    monkeypatch.setenv("TANDEM_CPU_FLASH_MIN_QUERY_ROWS", "off")
    monkeypatch.setattr(cpu_paged_attention, "FLASH_MIN_QUERY_ROWS", None)
    monkeypatch.setattr(cpu_paged_attention, "FLASH_ROUTE_SOURCE", "set")
    monkeypatch.setattr(cpu_int8_route, "_calibrated", True)
    monkeypatch.setattr(cpu_int8, "AMX_PACKED_MAX_ROWS", None)


@pytest.fixture(scope="module")
def windowed_checkpoint(tmp_path_factory) -> str:
    """Mistral with a 6-token window on every layer, 4 query heads per KV head: windows and GQA in the stack."""
    path = tmp_path_factory.mktemp("windowed")
    return str(build_checkpoint(path, "mistral", **{**TINY_CONFIGS["mistral"], "sliding_window": 6}))


def bf16_llm(path: str) -> LLM:
    return LLM(model=path, model_config={"dtype": "bfloat16", "device": "cpu"}, max_batch_size=8,
               max_batch_input_tokens=64, max_length=128, kv_cache={"cpu_kv_cache_gib": 0.05})


class CountingStack:
    """The model's stack, counting the steps it ran."""

    def __init__(self, stack):
        self.stack, self.steps, self.prompt_rows = stack, 0, 0

    def takes(self, batch) -> bool:
        return self.stack.takes(batch)

    def __call__(self, embedded, batch, kv_cache):
        self.steps += 1
        self.prompt_rows += batch.num_tokens - batch.num_seqs  # rows past each sequence's first
        return self.stack(embedded, batch, kv_cache)


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int):
    """Greedy tokens with their top-3 logprobs; every other prompt's own logprobs too (its prompt chunks then run
    every row through the last layer: the stack takes those steps, many query rows per sequence)."""
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=3,
                             prompt_logprobs=1 if index % 2 else None) for index in range(len(prompts))]
    return [(out.token_ids, out.logprobs, out.prompt_logprobs) for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("arch", ["llama", "windowed", "qwen2", "qwen3", "gemma3", "gemma3_untied"])
def test_one_call_per_step_gives_the_layer_by_layer_bits(panels, threads, tiny_checkpoint, windowed_checkpoint,
                                                         gemma3_checkpoint, arch):
    """gemma3: local and global layers (their own windows and RoPE caches), offset norms, GELU-tanh, softcapped
    logits; gemma3_untied: biased projections, one KV head, global layers first."""
    path = {"windowed": windowed_checkpoint}.get(arch) or (
        gemma3_checkpoint(arch) if arch.startswith("gemma3") else tiny_checkpoint(arch))
    check_same_bits(bf16_llm(path))


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_every_instruction_set_gives_the_layer_by_layer_bits(panels, isa, tiny_checkpoint, gemma3_checkpoint, arch):
    """The elementwise and attention bodies of each instruction set this CPU runs (AVX-512 with BF16 pairs, AVX-512,
    AVX2, the portable 16-lane ones, 16-byte vectors, scalar) chained by the stack as by their own calls."""
    check_same_bits(bf16_llm(gemma3_checkpoint(arch) if arch == "gemma3" else tiny_checkpoint(arch)))


def check_same_bits(llm: LLM) -> None:
    """The stack's tokens, logprobs and prompt logprobs against the same engine's layer by layer, bit for bit."""
    model = llm.engine.runner.model
    assert isinstance(model.native_decoder_stack, cpu_decoder_stack.NativeDecoderStack)
    counting = model.native_decoder_stack = CountingStack(model.native_decoder_stack)
    # prompts of different lengths, longer than the window, chunked (64 tokens a step): prefill, mixed and decode
    # steps, sequences joining and leaving
    prompts = [[3 + (7 * i + 5 * j) % 250 for j in range(length)] for i, length in enumerate((5, 40, 17, 90, 1))]
    fused = generate(llm, prompts, 12)
    model.native_decoder_stack = None
    llm.engine.kv_manager.reset_prefix_cache()
    layer_by_layer = generate(llm, prompts, 12)
    assert counting.steps >= 10  # the decode steps at least
    assert counting.prompt_rows > 0  # and prompt chunks whose logprobs are read
    assert fused == layer_by_layer  # tokens, every logprob and the prompts' logprobs, bit for bit


@pytest.mark.parametrize("scheme", ["w8a8_int8_channel", "w8a8_int8_tensor_static"])
def test_w8a8_layers_in_one_call_give_the_layer_by_layer_bits(gemm_body, threads, tiny_checkpoint,
                                                              quantized_checkpoint, scheme):
    """A compressed-tensors W8A8 checkpoint in bf16: every linear of every layer int8 (activations quantized per token,
    or by the static scale), in the stack as in its own call."""
    llm = bf16_llm(quantized_checkpoint(scheme, tiny_checkpoint("llama"))[0])
    model = llm.engine.runner.model
    stack = model.native_decoder_stack
    assert isinstance(stack, cpu_decoder_stack.NativeDecoderStack)
    assert all(linear.int8 is not None for linear in stack.linears) and stack.max_codes > 0
    check_same_bits(llm)


def test_gemma_layers_quantized_at_load_in_one_call_give_the_layer_by_layer_bits(gemm_body, gemma3_checkpoint):
    """``--quantization int8`` on Gemma 3: W8A8 linears between Gemma's norms, in the stack as in their own calls."""
    llm = LLM(model=gemma3_checkpoint("gemma3"), model_config={"dtype": "bfloat16", "device": "cpu",
                                                               "quantization": "int8"},
              max_batch_size=8, max_batch_input_tokens=64, max_length=128, kv_cache={"cpu_kv_cache_gib": 0.05})
    stack = llm.engine.runner.model.native_decoder_stack
    assert isinstance(stack, cpu_decoder_stack.NativeDecoderStack) and stack.is_gemma
    assert all(linear.int8 is not None for linear in stack.linears)
    check_same_bits(llm)


@pytest.mark.parametrize("mode", ["speculative", "overlap"])
def test_speculative_and_overlapped_steps_give_the_same_tokens_with_the_stack(panels, tiny_checkpoint, drafts,
                                                                             monkeypatch, mode):
    """A draft model's steps and the target's verify rows (several query rows a sequence) through the stack, and the
    overlap pipeline's steps run on its execution thread: the layer-by-layer tokens."""
    extra = ({"draft_model": {"model_path": drafts("llama", "small")}, "speculative": {"num_speculative_tokens": 3}}
             if mode == "speculative" else {"enable_overlap_scheduler": True})

    def run() -> tuple[list, int]:
        llm = LLM(model=tiny_checkpoint("llama"), model_config={"dtype": "bfloat16", "device": "cpu"},
                  kv_cache={"page_size": 4, "num_blocks": 256}, **extra)
        model = llm.engine.runner.model
        counting = None
        if model.native_decoder_stack is not None:
            counting = model.native_decoder_stack = CountingStack(model.native_decoder_stack)
        prompts = [[3 + (7 * i + 5 * j) % 250 for j in range(n)] for i, n in enumerate((5, 30, 12))]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        return [out.token_ids for out in outputs], 0 if counting is None else counting.steps

    fused, steps = run()
    monkeypatch.setenv(cpu_decoder_stack.SWITCH_ENV, "0")
    layer_by_layer, no_steps = run()
    assert steps >= 5 and no_steps == 0
    assert fused == layer_by_layer


def test_layers_that_are_neither_plain_llama_nor_gemma_keep_the_layer_by_layer_path(panels, gpt_oss_checkpoint,
                                                                                     gemma3_checkpoint):
    """gpt-oss's attention sinks and mixture of experts are neither form: no stack, the model runs as before; nor a
    Gemma 3 layer with a hook on it (tensor parallelism's all-reduce)."""
    gemma = bf16_llm(gemma3_checkpoint("gemma3")).engine.runner.model
    assert gemma.plain_decoder_layers() is not None
    gemma.model.layers[2].mlp.register_forward_hook(lambda module, inputs, output: output)
    assert gemma.plain_decoder_layers() is None
    llm = bf16_llm(gpt_oss_checkpoint("gpt_oss"))
    assert llm.engine.runner.model.plain_decoder_layers() is None
    assert llm.engine.runner.model.native_decoder_stack is None
    assert len(generate(llm, [[5, 6, 7]], 3)[0][0]) == 3


def test_no_stack_for_fp32_hooked_layers_or_when_switched_off(panels, tiny_checkpoint, monkeypatch):
    from kernels.cpu_backend import prepare_model_cpu
    from pipeline.weights import load_model

    path = tiny_checkpoint("llama")
    fp32, _ = load_model(path, torch.float32, "cpu")
    prepare_model_cpu(fp32)
    assert fp32.native_decoder_stack is None
    hooked, _ = load_model(path, torch.bfloat16, "cpu")  # as tensor parallelism's all-reduce after each MLP
    hooked.model.layers[1].mlp.register_forward_hook(lambda module, inputs, output: output)
    assert hooked.plain_decoder_layers() is None
    prepare_model_cpu(hooked)
    assert hooked.native_decoder_stack is None
    monkeypatch.setenv(cpu_decoder_stack.SWITCH_ENV, "0")
    off, _ = load_model(path, torch.bfloat16, "cpu")
    prepare_model_cpu(off)
    assert off.native_decoder_stack is None
    monkeypatch.setenv(cpu_decoder_stack.SWITCH_ENV, "sometimes")
    with pytest.raises(ValueError, match="TANDEM_CPU_DECODER_STACK='sometimes'"):
        cpu_decoder_stack.for_model(off)


def test_it_takes_only_batches_every_linear_runs_on_panels(panels, tiny_checkpoint, monkeypatch):
    """On an AMX CPU batches above the measured row count run oneDNN: those steps go layer by layer; so do steps
    whose last layer keeps only the sampled rows, and batches laid out otherwise than the kernels read them."""
    llm = bf16_llm(tiny_checkpoint("llama"))
    stack = llm.engine.runner.model.native_decoder_stack
    rows = 4
    batch = ForwardBatch(
        input_ids=torch.zeros(rows, dtype=torch.int64), positions=torch.arange(rows),
        cu_seqlens_q=torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32),
        context_lens=torch.tensor([1, 2, 3, 4], dtype=torch.int32), slot_mapping=torch.arange(rows),
        block_tables=torch.zeros(4, 1, dtype=torch.int32), logits_indices=torch.arange(rows))
    assert stack.takes(batch)
    for linear in stack.linears:  # as an AMX CPU's layers hold oneDNN's copy beside the panels
        monkeypatch.setattr(linear.gemm, "packed", object())
    monkeypatch.setattr(cpu_gemm, "AMX_PANELS_MAX_ROWS", 3)
    assert not stack.takes(batch)
    monkeypatch.setattr(cpu_gemm, "AMX_PANELS_MAX_ROWS", 4)
    assert stack.takes(batch)
    assert not stack.takes(dataclasses.replace(batch, final_layer=batch))
    # an AMX CPU's bf16 prompts of 2 rows or more going to torch's flash attention: decodes still take the stack
    monkeypatch.setattr(cpu_paged_attention, "FLASH_MIN_QUERY_ROWS", 2)
    assert stack.takes(batch)
    three_rows = dataclasses.replace(batch, cu_seqlens_q=torch.tensor([0, 1, 4], dtype=torch.int32),
                                     context_lens=torch.tensor([1, 3], dtype=torch.int32),
                                     block_tables=torch.zeros(2, 1, dtype=torch.int32))
    assert not stack.takes(three_rows)
    monkeypatch.setattr(cpu_paged_attention, "FLASH_MIN_QUERY_ROWS", 4)
    assert stack.takes(three_rows)
    assert not stack.takes(dataclasses.replace(batch, context_lens=batch.context_lens.long()))
    assert not stack.takes(dataclasses.replace(batch, positions=torch.arange(2 * rows)[::2]))


def test_the_native_call_refuses_a_scratch_smaller_than_its_plan(panels, tiny_checkpoint):
    llm = bf16_llm(tiny_checkpoint("llama"))
    stack = llm.engine.runner.model.native_decoder_stack
    plan = stack._plan_for(llm.engine.runner.kv_cache)
    rows = 2
    embedded = torch.zeros(rows, stack.shape["hidden"], dtype=torch.bfloat16)
    scratch = torch.empty(rows * stack.scratch_per_row - 1, dtype=torch.bfloat16)
    index = torch.zeros(rows, dtype=torch.int64)
    with pytest.raises(ValueError, match="scratch smaller than the plan needs"):
        cpu_native.ops.decoder_stack(plan.data_ptr(), stack.floats.data_ptr(), embedded.data_ptr(),
                                     embedded.data_ptr(), embedded.data_ptr(), scratch.data_ptr(), scratch.numel(),
                                     index.data_ptr(), index.data_ptr(), index.data_ptr(), index.data_ptr(),
                                     index.data_ptr(), 1, rows, 1, 1)
