"""The KV page pool: the paged cache, FP8 codecs, integrity tags, block tables, and page I/O to a KV store."""
