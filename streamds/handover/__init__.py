"""Hand-over: how batches and tensors cross from worker processes to the main one."""
