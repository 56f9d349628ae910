"""Storage tiers: the DRAM segment (offset allocator over one registered buffer) and the SSD
tier (spill to files, read back, LRU-bounded)."""
