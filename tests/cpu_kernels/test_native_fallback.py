"""Without the native module (no C compiler at install, or ``TANDEM_NATIVE_KERNELS=0``), the CPU kernel set
is the torch references, and Tandem installs, loads and generates exactly what transformers generates."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_native, cpu_elementwise, cpu_paged_attention
from kernels.paged_attention_ref import paged_attention_ref
from tests.paged_batches import make_batch

ROOT = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter: greedy tokens of the engine and of transformers, and which kernels ran.
GENERATE = """
import json, os, sys
if os.environ.get("DROP_EDITABLE_INSTALL"):  # the copy on PYTHONPATH, not this checkout's editable install
    sys.meta_path = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
import torch
import kernels, kv_transfer.native
from kernels import cpu_native
from pipeline import LLM, SamplingParams
from transformers import AutoModelForCausalLM
path = sys.argv[1]
prompts = [[5, 9, 13, 2, 7], [11] * 19, [3, 4]]
llm = LLM(model=path, kv_cache={"page_size": 4, "num_blocks": 64}, max_batch_input_tokens=8)
ours = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
theirs = [hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                      pad_token_id=0)[0, len(p):].tolist() for p in prompts]
print(json.dumps({"ours": ours, "theirs": theirs, "native": cpu_native.ops is not None,
                  "copysum": kv_transfer.native.copy_checksum is not None, "kernels_dir": kernels.__file__,
                  "kernel_set": llm.engine.kernels.name}))
"""


def run_generate(checkpoint: str, env: dict[str, str], cwd: Path | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", GENERATE, checkpoint], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=240, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_without_the_module_every_cpu_kernel_is_the_reference(monkeypatch):
    monkeypatch.setattr(cpu_native, "ops", None)
    torch.manual_seed(0)
    batch = make_batch([1, 7], [30, 7], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=4)
    assert not cpu_paged_attention.native_applies(*batch[:3])
    assert torch.equal(cpu_paged_attention.paged_attention_cpu(*batch, 0.125), paged_attention_ref(*batch, 0.125))
    x = torch.randn(3, 64)
    assert not cpu_elementwise._rows_ok(x)


def test_native_kernels_turned_off_generate_like_transformers(tiny_checkpoint):
    out = run_generate(tiny_checkpoint("llama"), {"TANDEM_NATIVE_KERNELS": "0"})
    assert out["native"] is False and "torch reference (native kernels turned off: TANDEM_NATIVE_KERNELS=0)" == \
        out["kernel_set"].removeprefix("cpu: ")
    assert out["ours"] == out["theirs"]


def test_installed_without_a_c_compiler(tiny_checkpoint, tmp_path):
    """pip install with a compiler that always fails: the install succeeds without either native module,
    and the installed copy (first on the path) loads and generates exactly."""
    source, target = tmp_path / "source", tmp_path / "site"
    # the checkout as a fresh clone has it: none of this machine's builds (an editable install builds in place)
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        "*.so", "build", "*.egg-info", "__pycache__", ".venv*", ".git", "results", ".pytest_cache"))
    env = {**os.environ, "CC": "false", "CXX": "false", "LDSHARED": "false", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target",
         str(target), str(source)],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert not list(target.rglob("*.so")), "a native module was built by a compiler that always fails"
    out = run_generate(tiny_checkpoint("llama"), {"PYTHONPATH": str(target), "DROP_EDITABLE_INSTALL": "1"},
                       cwd=tmp_path)
    assert out["kernels_dir"].startswith(str(target))
    assert out["native"] is False and out["copysum"] is False
    assert out["ours"] == out["theirs"]
