"""The delta codec: a chunk of a packed version sent as its difference from the chunk the
receiver already holds. Shared by every path that sends versions across hosts (Ray's
cross-host stream, the network path to ``vllm serve``); it imports no transport."""
