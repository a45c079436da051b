"""A rogue on the cluster's network: a plain pyzmq process that tries to join a Tandem cluster.

``python -m tests.security.rogue ROUTER_ENDPOINT WORKER_ENDPOINT... [--key-file F]`` registers as a decode
worker with the router, sends a ``PrefillRequest`` and pushes a KV piece (``Blocks`` header + raw bytes)
to every worker endpoint, for ``--seconds``, and prints ``{"replies": N}``: every message any of them
answered. Without ``--key-file`` it speaks plain ZMQ; with one (another cluster's key) it speaks CURVE
with that key, using its own public key as the server's (it cannot know ours).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import zmq
import zmq.auth

from pipeline.protocol.cluster import PrefillRequest, RegisterWorker, WorkerRole, encode
from pipeline.protocol.requests import SamplingParams
from pipeline.protocol.transfer import Blocks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("router")
    parser.add_argument("workers", nargs="*")
    parser.add_argument("--key-file", default=None)
    parser.add_argument("--model-name", default="model")
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    ctx = zmq.Context()
    key = zmq.auth.load_certificate(args.key_file) if args.key_file else None

    def dealer(endpoint: str, identity: bytes) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.identity = identity
        if key is not None:
            sock.curve_publickey, sock.curve_secretkey = key
            sock.curve_serverkey = key[0]
        sock.connect(endpoint)
        return sock

    register = RegisterWorker(worker_id="rogue-0", role=WorkerRole.DECODE_ONLY,
                              model_name=args.model_name, max_length=4096, page_size=4, num_total_blocks=4096,
                              pid=os.getpid(), max_batch_size=64)
    prefill = PrefillRequest(request_id="rogue-req", prompt_token_ids=list(range(1, 33)),
                             sampling_params=SamplingParams(max_tokens=4), dst_block_ids=list(range(8)),
                             num_cached_tokens=0, transfer_endpoint="tcp://127.0.0.1:9", decode_worker_id="decode-0",
                             ttl_s=30.0)
    kv = Blocks(request_id="rogue-req", layer_start=0, layer_stop=1, dst_block_ids=[0], num_bytes=4096)
    sockets = [dealer(args.router, b"rogue-0")]
    for endpoint in args.workers:
        sockets.append(dealer(endpoint, b"rogue-peer"))
    poller = zmq.Poller()
    for sock in sockets:
        poller.register(sock, zmq.POLLIN)
    num_replies = 0
    deadline = time.monotonic() + args.seconds
    next_send = 0.0
    while time.monotonic() < deadline:
        if time.monotonic() >= next_send:  # again and again: messages queue until a handshake would finish
            next_send = time.monotonic() + 0.5
            for sock in sockets:
                frames = [[encode(register)]] if sock is sockets[0] else [
                    [encode(prefill)], [encode(kv), b"\0" * 4096]]
                for message in frames:
                    try:
                        sock.send_multipart(message, zmq.NOBLOCK)
                    except zmq.Again:
                        pass
        for sock, _ in poller.poll(100):
            sock.recv_multipart()
            num_replies += 1
    print(json.dumps({"replies": num_replies}), flush=True)
    for sock in sockets:
        sock.close()
    ctx.term()


if __name__ == "__main__":
    main()
