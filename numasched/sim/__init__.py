"""numasched.sim: L2 simulator for chiplet GPUs (see README)."""
