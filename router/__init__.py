"""The router: Tandem's OpenAI-compatible HTTP front door. It never imports torch.

- ``app``: the FastAPI app factory ``create_app`` and the process entry point ``run_router``.
- ``openai_schema``: pydantic bodies of /v1/completions and /v1/chat/completions.
- ``preprocess``: tokenization and every 400/404 check, turning a body into prompt ids + SamplingParams.
- ``serving``: one request's life after validation: dispatch, stream or collect, stop, cancel, time out.
- ``streaming``: TokenDeltas to OpenAI text, stop strings, logprobs and usage; chunk and response shapes.
- ``dispatcher``: the ZMQ ROUTER socket to the workers, per-request queues, retries when workers die.
- ``registry``: registered workers, their load reports and liveness by heartbeat deadline.
- ``policy``: the pure function that picks (prefill worker or None, decode worker) from load reports.
- ``served_model``: the served model's name, tokenizer, vocabulary size and length limit.
- ``metrics``: Prometheus metrics on a per-app registry, per-worker ones read at scrape time.
- ``errors``: the OpenAI error body and the handlers that give every error that shape.
"""
