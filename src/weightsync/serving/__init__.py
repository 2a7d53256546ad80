"""The inference-server side of the network path, engine-neutral: what runs on a server's
host whatever engine serves there (vLLM today; SGLang could reuse it). Nothing here
imports an inference engine.

* ``host_receiver``: the host's one receiver, staging each version the trainer streams as
  a committed slot of a private host-local directory every rank of the engine loads;
* ``adapter_files``: a LoRA adapter's versions as files on the server's host, one
  directory per version, for the engine's LoRA loader;
* ``adapter_copy``: one adapter version copied, verified, out of its slot into the files a
  LoRA loader reads;
* ``owners``: owner records, so the next server on the host removes what a killed one left;
* ``sessions``: one trainer per server at a time (an init of another session ends the last).
"""
