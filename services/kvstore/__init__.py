"""The KV page store service: RAM + disk tiers indexed by block hash, pages moved by the TE."""
