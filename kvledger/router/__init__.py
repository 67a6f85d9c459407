"""Data-parallel dispatch: which replica gets a request (policy), from what it knows of each
replica's cache (index, fed by KV events) and load (bookkeeping of what it dispatched)."""
