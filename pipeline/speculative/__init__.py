"""Speculative decoding with a draft model: the draft proposes K tokens, one target forward verifies them
(exact for greedy and sampling), and the draft's KV lives beside the target's in the same blocks."""
