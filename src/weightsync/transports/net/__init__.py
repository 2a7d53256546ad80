"""The network transport: one version of a model streamed from the trainer to each
receiving host over an authenticated TCP connection, as checksummed chunks (whole, or as
deltas against the version that host holds). Used by the network path to ``vllm serve``
(``weightsync.integrations.vllm``); it imports no framework.

* ``wire``: frames (small typed JSON headers, raw chunk bytes) and the chunk checksum;
* ``handshake``: both ends prove the shared token (HMAC challenge-response);
* ``packed``: a version as one byte buffer plus its typed layout;
* ``publisher``: the trainer's listener, serving the current version to each host;
* ``fetch``: a host's side, receiving and verifying a version.
"""
