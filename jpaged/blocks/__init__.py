"""The block vocabulary: the device allocator (`allocator`), its host mirror (`mirror`), typed
block operations (`ops`), the ledger that is the mirror's only writer and the operations' only
producer (`ledger`), the prefix cache (`prefix_cache`) and host swap storage (`swap`).

Outside this package nothing imports the mirror: the scheduler and the engine speak to the
ledger, and the executor applies the operations it hands out."""
