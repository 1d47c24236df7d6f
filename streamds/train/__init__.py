"""The training side: batching, collates, device prefetch, the stall meter."""
