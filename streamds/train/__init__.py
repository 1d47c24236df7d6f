"""The training side: batching, rebatching, collates, device prefetch, the stall meter."""
