"""``weightsync demo``: the CartPole trainer (``trainer``) with its collector processes or Ray
actors (``collectors``) and live table and plot (``display``), the same over TorchRL's
collectors (``torchrl``), and the LLM half (``llm``, ``llm_task``): a policy-gradient loop
between a trainer and a real vLLM engine."""
