"""The long-running service: the libvirt hook, how agents are launched, the agent and its per-disk cycle."""
