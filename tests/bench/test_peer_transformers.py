"""The benchmark's peer: the checkpoint whose EOS greedy decoding cannot reach, and (slow, needs
``accelerate``) ``transformers serve --continuous-batching`` driven by the benchmark client."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.peer_transformers import TransformersServe, make_eos_unreachable


@pytest.fixture(scope="module")
def no_eos_checkpoint(tiny_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("no-eos") / "ckpt"
    shutil.copytree(tiny_checkpoint("llama"), path)
    make_eos_unreachable(path)
    return path


def test_greedy_decoding_never_reaches_eos(no_eos_checkpoint):
    eos = json.loads((no_eos_checkpoint / "config.json").read_text())["eos_token_id"]
    model = AutoModelForCausalLM.from_pretrained(no_eos_checkpoint, torch_dtype=torch.float32).eval()
    assert torch.count_nonzero(model.lm_head.weight[eos]) == 0
    prompts = torch.tensor([[1, 5, 9, 14], [1, 30, 2, 7], [1, 8, 8, 8]])
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=48, do_sample=False,
                             eos_token_id=eos, pad_token_id=0)
        logits = model(out).logits
    assert out.shape[1] == 4 + 48 and not (out[:, 4:] == eos).any()
    assert (logits[..., eos] == 0).all() and (logits.max(-1).values > 0).all()


def test_a_checkpoint_that_names_no_eos_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": None}))
    with pytest.raises(ValueError, match="eos_token_id"):
        make_eos_unreachable(tmp_path)


@pytest.mark.slow
def test_transformers_serve_through_the_benchmark_client(no_eos_checkpoint):
    pytest.importorskip("accelerate")
    from transformers import AutoTokenizer

    from bench.serve import benchmark
    from bench.serve_client import ClientSettings
    from bench.serve_workload import WorkloadSpec

    spec = WorkloadSpec(num_prompts=6, input_len=24, output_len=12)
    with TransformersServe(no_eos_checkpoint, cores=None, num_threads=None,
                           extra_args=["--cb-num-blocks", "16", "--cb-max-batch-tokens", "256"]) as server:
        client = ClientSettings(base_url=server.url, endpoint=server.endpoint, model=server.model_name)
        report = benchmark(client, spec, [float("inf")], tokenizer=AutoTokenizer.from_pretrained(no_eos_checkpoint),
                           progress=False)
    run = report["runs"][0]
    assert run["completed"] == 6 and run["failed"] == 0 and run["total_output_tokens"] == 6 * 12
    assert "tandem" not in run  # not a Tandem router: nothing scraped
