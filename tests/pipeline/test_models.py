"""Llama-family models and checkpoint loading: logits match transformers, bad checkpoints fail clearly."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import ARCHITECTURES, TINY_CONFIGS
from kernels import load_kernels
from pipeline.builtin_model import build_checkpoint
from pipeline.forward_batch import ForwardBatch
from pipeline.model_runner import kv_cache_shape
from pipeline.models.registry import SUPPORTED_ARCHITECTURES
from pipeline.weights import CheckpointError, iter_safetensors, load_model

KERNELS = {name: load_kernels(name) for name in ("torch", "cpu")}  # the references, and the native CPU set
PAGE_SIZE = 4
ATOL = 1e-4


class PagedSequences:
    """Test stand-in for the block manager: each sequence owns scattered blocks of one KV cache."""

    def __init__(self, model, num_seqs: int, max_len: int, page_size: int = PAGE_SIZE, seed: int = 0):
        blocks_per_seq = -(-max_len // page_size)
        generator = torch.Generator().manual_seed(seed)
        num_blocks = num_seqs * blocks_per_seq + 3  # a few never-used blocks
        pool = torch.randperm(num_blocks, generator=generator)[: num_seqs * blocks_per_seq]
        self.block_tables = pool.view(num_seqs, blocks_per_seq).to(torch.int32)  # [num_seqs, blocks_per_seq]
        self.page_size = page_size
        self.num_cached = [0] * num_seqs
        # garbage, not zeros: a slot read before it is written would show up in the logits
        shape = kv_cache_shape(model.hf_config, num_blocks, page_size)  # K/V pages, or latent rows (MLA)
        self.kv_cache = torch.randn(shape, generator=generator)

    def step(self, new_tokens: list[list[int]]) -> ForwardBatch:
        """Flat batch appending ``new_tokens[i]`` to sequence i (sequences with no new tokens sit out)."""
        rows = [i for i, tokens in enumerate(new_tokens) if tokens]
        input_ids, positions, slots, cu_seqlens, context_lens = [], [], [], [0], []
        for i in rows:
            start = self.num_cached[i]
            for pos in range(start, start + len(new_tokens[i])):
                block = int(self.block_tables[i, pos // self.page_size])
                positions.append(pos)
                slots.append(block * self.page_size + pos % self.page_size)
            input_ids += new_tokens[i]
            self.num_cached[i] += len(new_tokens[i])
            cu_seqlens.append(len(input_ids))
            context_lens.append(self.num_cached[i])
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32),
            context_lens=torch.tensor(context_lens, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=self.block_tables[rows],
            logits_indices=torch.arange(len(input_ids)),
        )


def run_logits(model, paged: PagedSequences, new_tokens: list[list[int]], backend: str = "torch") -> torch.Tensor:
    with torch.inference_mode():
        hidden = model(paged.step(new_tokens), paged.kv_cache, KERNELS[backend])  # [num_tokens, hidden]
        return model.compute_logits(hidden)  # [num_tokens, vocab]


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()  # [len, vocab]


def random_tokens(vocab_size: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def bf16_logits(path, hf_fp32_model, backend: str):
    """27 random tokens (a prefill of 19, then 8 over its cache) through our bf16 model prepared for ``backend``,
    transformers' bf16 model and ``hf_fp32_model``: (our model, our logits, transformers' bf16 logits, the fp32
    logits), ``[27, vocab]`` each. bf16 rounds differently in every implementation: the tests hold ours to
    transformers' own distance from fp32."""
    from transformers import AutoModelForCausalLM

    model, hf_config = load_model(path, torch.bfloat16, "cpu")
    KERNELS[backend].prepare_model(model)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    tokens = random_tokens(hf_config.vocab_size, 27, seed=5)
    paged = PagedSequences(model, num_seqs=1, max_len=len(tokens))
    paged.kv_cache = paged.kv_cache.to(torch.bfloat16)
    ours = torch.cat([run_logits(model, paged, [tokens[:19]], backend),
                      run_logits(model, paged, [tokens[19:]], backend)])
    return model, ours, hf_logits(hf_bf16, tokens), hf_logits(hf_fp32_model, tokens)


def check_batch_over_cached_prefix(model, hf_config, hf_model, backend: str, prefix_lens: list[int],
                                   continue_lens: list[int], num_decodes: int = 1, seed: int = 10,
                                   atol: float = 1e-4) -> PagedSequences:
    """Prefill the sequences together, continue them over their cached prefixes, then ``num_decodes`` decode
    steps: every token's logits within ``atol`` of transformers' over the whole sequence, the same argmax.
    Returns the paged cache (a caller may check its geometry)."""
    full = [random_tokens(hf_config.vocab_size, p + c + num_decodes, seed=seed + i)
            for i, (p, c) in enumerate(zip(prefix_lens, continue_lens))]
    paged = PagedSequences(model, num_seqs=len(full), max_len=max(map(len, full)))
    steps = [
        [seq[:p] for seq, p in zip(full, prefix_lens)],
        [seq[p : p + c] for seq, p, c in zip(full, prefix_lens, continue_lens)],
        *[[seq[len(seq) - num_decodes + d : len(seq) - num_decodes + d + 1] for seq in full]
          for d in range(num_decodes)],  # decode: one token per sequence a step
    ]
    got = [run_logits(model, paged, step, backend) for step in steps]
    for i, seq in enumerate(full):
        expected = hf_logits(hf_model, seq)  # [len, vocab]
        ours = torch.cat([step_logits[sum(map(len, step[:i])) : sum(map(len, step[: i + 1]))]
                          for step, step_logits in zip(steps, got)])
        torch.testing.assert_close(ours, expected, atol=atol, rtol=0)
        assert torch.equal(ours.argmax(-1), expected.argmax(-1))
    return paged


def loaded_models(checkpoint, hf_reference):
    """``get(name, backend)`` -> (our fp32 model of ``checkpoint(name)`` prepared for ``backend``, hf_config,
    transformers' model), each loaded once: the body of every model test module's ``loaded`` fixture."""
    cache: dict[tuple[str, str], tuple] = {}

    def get(name: str, backend: str = "torch"):
        if (name, backend) not in cache:
            path = checkpoint(name)
            model, hf_config = load_model(path, torch.float32, "cpu")
            KERNELS[backend].prepare_model(model)
            cache[name, backend] = (model, hf_config, hf_reference(path)[0])
        return cache[name, backend]

    return get


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint, hf_reference):
    """``loaded(arch, backend)`` -> (our fp32 model prepared for ``backend``, hf_config, transformers model)."""
    return loaded_models(tiny_checkpoint, hf_reference)


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # untied, and tied to the embedding
def test_a_cpu_model_holds_its_linear_weights_once_where_packing_serves_every_call(
        monkeypatch, tiny_checkpoint, hf_reference, arch):
    """With oneDNN's packed weights taking every row count (an AVX-512 CPU's rule, forced here on any CPU), each
    linear layer's parameter is let go once packed: it keeps its shape on the meta device, the tied embedding
    keeps its rows, and the model still computes transformers' logits."""
    from kernels import cpu_gemm

    if not cpu_gemm.onednn_available():
        pytest.skip("no oneDNN in this torch build")
    monkeypatch.setattr(cpu_gemm, "PACKED_MIN_ROWS", 1)
    monkeypatch.setattr(cpu_gemm, "PACKED_MAX_ROWS", None)
    path = tiny_checkpoint(arch)
    model, hf_config = load_model(path, torch.float32, "cpu")
    KERNELS["cpu"].prepare_model(model)
    linears = [m for m in model.modules() if hasattr(m, "gemm")]
    assert linears and all(m.gemm is not None and m.weight.is_meta for m in linears)
    assert model.model.embed_tokens.weight.device.type == "cpu"
    assert (model.lm_head is None) == hf_config.tie_word_embeddings
    check_batch_over_cached_prefix(model, hf_config, hf_reference(path)[0], "cpu", prefix_lens=[5, 9],
                                   continue_lens=[3, 1], num_decodes=2)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_single_prefill_matches_transformers(loaded, arch, backend):
    model, hf_config, hf_model = loaded(arch, backend)
    tokens = random_tokens(hf_config.vocab_size, 21, seed=1)
    paged = PagedSequences(model, num_seqs=1, max_len=len(tokens))

    logits = run_logits(model, paged, [tokens], backend)
    expected = hf_logits(hf_model, tokens)

    assert logits.dtype == torch.float32 and logits.shape == (21, hf_config.vocab_size)
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))  # greedy decoding is token-exact


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_batch_over_cached_prefix_matches_transformers(loaded, arch, backend):
    """Prefill three sequences together, continue them over their cached prefixes, then one decode step."""
    model, hf_config, hf_model = loaded(arch, backend)
    check_batch_over_cached_prefix(model, hf_config, hf_model, backend, [9, 14, 5], [3, 1, 4], atol=ATOL)


@pytest.mark.parametrize(
    "arch, overrides, windows",
    [
        ("mistral", dict(sliding_window=5), [5, 5]),
        ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1), [None, 5]),
    ],
)
@pytest.mark.parametrize("backend", KERNELS)
def test_sliding_window_matches_transformers(tmp_path, hf_reference, arch, overrides, windows, backend):
    settings = {**TINY_CONFIGS[arch], **overrides}
    path = str(build_checkpoint(tmp_path / arch, arch, **settings))
    model, hf_config = load_model(path, torch.float32, "cpu")
    KERNELS[backend].prepare_model(model)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == windows
    hf_model = hf_reference(path)[0]
    tokens = random_tokens(hf_config.vocab_size, 18, seed=3)
    paged = PagedSequences(model, num_seqs=1, max_len=len(tokens))

    logits = torch.cat([run_logits(model, paged, [tokens[:15]], backend),
                        run_logits(model, paged, [tokens[15:]], backend)])

    torch.testing.assert_close(logits, hf_logits(hf_model, tokens), atol=ATOL, rtol=0)


def test_sharded_checkpoint_loads(tmp_path, tiny_checkpoint, hf_reference, loaded):
    path = tiny_checkpoint("qwen3")
    hf_model = hf_reference(path)[0]
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1

    model, _ = load_model(sharded, torch.float32, "cpu")

    reference, _, _ = loaded("qwen3")
    for (name, param), (ref_name, ref_param) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert name == ref_name and torch.equal(param, ref_param), name
    tokens = random_tokens(hf_model.config.vocab_size, 10, seed=4)
    logits = run_logits(model, PagedSequences(model, 1, len(tokens)), [tokens])
    torch.testing.assert_close(logits, hf_logits(hf_model, tokens), atol=ATOL, rtol=0)


def test_bf16_checkpoint_is_cast_to_the_requested_dtype(llama_copy):
    rewrite_weights(llama_copy, lambda t: t.update({name: x.to(torch.bfloat16) for name, x in t.items()}))
    config = json.loads((llama_copy / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (llama_copy / "config.json").write_text(json.dumps(config))

    model, _ = load_model(llama_copy, torch.float32, "cpu")

    assert all(p.dtype == torch.float32 for p in model.parameters())
    on_disk = dict(iter_safetensors(llama_copy))
    assert on_disk["model.norm.weight"].dtype == torch.bfloat16
    assert torch.equal(model.model.norm.weight, on_disk["model.norm.weight"].float())


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # qwen2: biased q/k/v
def test_bf16_is_as_close_to_transformers_bf16_as_bf16_is_to_fp32(tiny_checkpoint, hf_reference, arch, backend):
    """bf16 rounds differently in every implementation; ours must stay within bf16's own noise: no
    further from transformers' bf16 logits than those are from fp32 (a broken kernel is far off)."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(arch)
    model, hf_config = load_model(path, torch.bfloat16, "cpu")
    KERNELS[backend].prepare_model(model)
    hf_fp32 = hf_reference(path)[0]
    hf_bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    tokens = random_tokens(hf_config.vocab_size, 23, seed=5)
    paged = PagedSequences(model, num_seqs=1, max_len=len(tokens))
    paged.kv_cache = paged.kv_cache.to(torch.bfloat16)
    ours = torch.cat([run_logits(model, paged, [tokens[:19]], backend), run_logits(model, paged, [tokens[19:]], backend)])
    theirs, exact = hf_logits(hf_bf16, tokens), hf_logits(hf_fp32, tokens)
    bf16_noise = (theirs - exact).abs().max().item()
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 2 * bf16_noise + 1e-2


# --- checkpoints that cannot be used ---------------------------------------------------------------


@pytest.fixture
def llama_copy(tmp_path, tiny_checkpoint) -> Path:
    """A private copy of the tiny llama checkpoint, free to break."""
    return Path(shutil.copytree(tiny_checkpoint("llama"), tmp_path / "copy"))


def rewrite_weights(directory: Path, edit) -> None:
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def test_unsupported_architecture_lists_supported_ones(llama_copy):
    config = json.loads((llama_copy / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (llama_copy / "config.json").write_text(json.dumps(config))

    with pytest.raises(CheckpointError, match="unsupported architecture GPT2LMHeadModel") as error:
        load_model(llama_copy, torch.float32, "cpu")
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(error.value)


def test_missing_weights_file_names_what_was_expected(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no weights in .*model\.safetensors"):
        load_model(llama_copy, torch.float32, "cpu")


def test_missing_shard_is_named(tmp_path, tiny_checkpoint, hf_reference):
    sharded = tmp_path / "sharded"
    hf_reference(tiny_checkpoint("llama"))[0].save_pretrained(sharded, max_shard_size="20KB")
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"shard .*{victim.name}.* is missing"):
        load_model(sharded, torch.float32, "cpu")


def test_wrong_tensor_shape_names_tensor_and_shapes(llama_copy):
    name = "model.layers.1.self_attn.k_proj.weight"  # [num_kv_heads * head_dim, hidden] = [32, 64]
    rewrite_weights(llama_copy, lambda t: t.__setitem__(name, t[name].reshape(64, 32).contiguous()))
    with pytest.raises(CheckpointError, match=rf"{name} has shape \(64, 32\).*expects \(32, 64\)"):
        load_model(llama_copy, torch.float32, "cpu")


def test_missing_tensor_is_named(llama_copy):
    rewrite_weights(llama_copy, lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): model\.layers\.0\.mlp\.up_proj\.weight"):
        load_model(llama_copy, torch.float32, "cpu")


def test_unexpected_tensor_is_refused_and_rotary_buffers_are_ignored(llama_copy):
    rewrite_weights(llama_copy, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    load_model(llama_copy, torch.float32, "cpu")  # a stale rope buffer is harmless

    rewrite_weights(llama_copy, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.0\.self_attn\.o_proj\.bias"):
        load_model(llama_copy, torch.float32, "cpu")


def test_directory_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere", torch.float32, "cpu")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path, torch.float32, "cpu")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"cannot read the model config .*config\.json"):
        load_model(tmp_path, torch.float32, "cpu")


def test_model_modules_import_without_transformers_or_triton():
    code = (
        "import sys, pipeline.weights, pipeline.models.registry; "
        "print(sorted(m for m in ('transformers', 'triton', 'safetensors') if m in sys.modules))"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
