"""The serving benchmark's peer: ``transformers serve --continuous-batching`` (transformers' own paged
continuous-batching server, OpenAI-compatible), started and stopped around a benchmark run.

The command, as :class:`TransformersServe` builds it (cores, threads and port filled in)::

    HF_HOME=<empty temp dir> HF_HUB_OFFLINE=1 HF_HUB_DISABLE_UPDATE_CHECK=1 OMP_NUM_THREADS=2 \\
    taskset -c 0,1 .venv/bin/transformers serve /path/to/checkpoint \\
        --continuous-batching --device cpu --host 127.0.0.1 --port PORT [extra args]

What it does, as read in transformers 5.23 (``transformers/cli/serve.py``, ``cli/serving/``) and seen:

- The checkpoint is the positional ``FORCE_MODEL``, loaded before the server binds its port, so
  ``GET /health`` answers only once the weights are in. Every request must name exactly that string
  as ``model`` (or none): any other is a 400. ``GET /v1/models`` lists the HF cache (empty here), not
  the served model, so the benchmark must pass the model name itself. A path must not contain ``@``
  (read as a revision). ``HF_HUB_DISABLE_UPDATE_CHECK`` stops the CLI asking PyPI for a newer version.
- Endpoints: ``POST /v1/completions`` (the prompt tokenized as is, no chat template) and
  ``/v1/chat/completions``, streaming or not; ``/v1/responses``; ``GET /health``, ``GET /v1/models``.
  No ``[DONE]`` line ends a stream: it just ends.
- The last chunk of every stream carries ``usage`` (prompt and completion tokens) whatever
  ``stream_options`` says; ``stream_options`` is accepted and ignored. A field the OpenAI schema does
  not know is a 422: ``ignore_eos`` is refused, hence :func:`make_eos_unreachable`.
- A content chunk is one token's text, except that a token whose bytes do not decode to text yet
  sends none, and tokens queued while the event loop was busy go out in one write. Count tokens
  with ``usage.completion_tokens``, not chunks (nor by re-tokenizing the text: it does not round-trip).
- Continuous batching is set up by the first generation request, whose sampling settings then hold
  for every later request (only ``max_tokens`` and EOS are per request). That request also allocates
  the paged KV cache and, on CPU, a preallocated fp32 attention mask of ``max_batch_tokens`` x
  (cache tokens + ``max_batch_tokens``): by default 60% of free RAM (here ~10 s and ~5 GB resident,
  most of it the mask), else ``--cb-num-blocks N`` blocks of 256 tokens and ``--cb-max-batch-tokens M``
  (default 8192). :meth:`TransformersServe.start` sends a greedy warm-up request, so that none of this
  lands in a measurement and the server is greedy for good.
- On CPU the model runs in its checkpoint's dtype (``--dtype auto``) with SDPA over each step's
  sequences flattened into one, under a block-diagonal mask (flash attention is not available on
  CPU); no CUDA graphs, no torch.compile.
- SIGTERM shuts it down cleanly, but only once open streams have finished: hence the SIGKILL fallback.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.peer_server import ENDPOINT, PeerServer, free_port

__all__ = ["ENDPOINT", "TransformersServe", "free_port", "make_eos_unreachable"]


def make_eos_unreachable(checkpoint_dir: Path) -> None:
    """Zero the output-projection rows of the checkpoint's EOS tokens, in ``model.safetensors`` in place.

    The EOS logits are then exactly 0, while the largest of the other logits of a random-weight model
    is positive, so greedy decoding never ends a request early: the stand-in for ``ignore_eos``, which
    ``transformers serve`` refuses. With tied embeddings the output projection is the embedding table.
    """
    checkpoint_dir = Path(checkpoint_dir)
    config = json.loads((checkpoint_dir / "config.json").read_text())
    eos = config.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos]
    if None in eos_ids:
        raise ValueError(f"{checkpoint_dir}/config.json names no eos_token_id")
    weights_path = checkpoint_dir / "model.safetensors"
    weights, metadata = _load_safetensors(weights_path)
    head = "model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"
    if head not in weights:
        raise ValueError(f"{weights_path} has no {head} (a sharded or renamed checkpoint is not supported)")
    if head.replace(".weight", ".bias") in weights:
        raise ValueError(f"{weights_path}: {head} has a bias, zeroing its rows would not zero the logits")
    weights[head][eos_ids] = 0
    from safetensors.torch import save_file

    save_file(weights, weights_path, metadata=metadata)


def _load_safetensors(path: Path) -> tuple[dict, dict[str, str] | None]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, f.metadata()


class TransformersServe(PeerServer):
    """``transformers serve --continuous-batching`` on ``model_path``, on 127.0.0.1, pinned to ``cores``
    (``taskset``) with ``num_threads`` torch threads (``OMP_NUM_THREADS``); ``None`` leaves either as is.

    ``extra_args`` go at the end of the command line, e.g. ``["--cb-num-blocks", "64"]``.
    """

    name = "transformers serve"

    def __init__(self, model_path: str | os.PathLike, *, cores: list[int] | None, num_threads: int | None,
                 port: int | None = None, log_path: Path | None = None, extra_args: Sequence[str] = ()) -> None:
        super().__init__(port=port, log_path=log_path)
        self.model_name = str(model_path)
        self.num_threads = num_threads
        serve = [str(Path(sys.executable).with_name("transformers")), "serve", self.model_name,
                 "--continuous-batching", "--device", "cpu", "--host", "127.0.0.1", "--port", str(self.port),
                 *extra_args]
        pin = ["taskset", "-c", ",".join(map(str, cores))] if cores else []
        self.command = pin + serve

    def environment(self, scratch: Path) -> dict[str, str]:
        hf_home = scratch / "hf_home"
        (hf_home / "hub").mkdir(parents=True)  # without it, GET /v1/models is a 500
        env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"}
        if self.num_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.num_threads)
        return env
