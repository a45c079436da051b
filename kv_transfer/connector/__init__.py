"""The KV connector pair: the one home of every KV move between workers (remote prefill, live migration
on drain, an early prefill a decode worker claims). See ``docs/kv-connector.md``.

Modules, one sentence each:

- ``engine_port``: the narrow engine interface the halves use (``SourceEngine``, ``SinkEngine``), so this
  package never imports the engine.
- ``source``: ``KVSource``, the sending half (prefill worker, draining decode worker): accept or claim,
  ship blocks as chunks complete, finish with the done message, reap, drop; one ``SourceTransfer`` per
  request with a ``SourceStatus``.
- ``sink``: ``KVSink``, the receiving half (decode worker): reserve, expect, request, keep the TTLs, poll,
  activate; one ``SinkTransfer`` per request with a ``SinkStatus``.
- ``source_links``: the sink's DEALER connections to sources, one per source endpoint.
- ``setup``: ``ConnectorSetup``, the one place that builds a worker's ``KVSender`` and ``KVReceiver``
  (and the halves around them).
"""
