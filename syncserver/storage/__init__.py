"""Where the hub keeps its bytes and records: keys, handles, durability (local disk today)."""
