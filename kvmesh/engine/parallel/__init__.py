"""One model split over several rank processes (tensor parallelism on CPU with gloo): the
shards (shard.py), the group and its all-reduce (group.py), rank 0's side (ranks.py) and the
other ranks' process (rank.py)."""
