"""The KV page pool: pages of every per-token cache, ref-counted, with the trash page."""
