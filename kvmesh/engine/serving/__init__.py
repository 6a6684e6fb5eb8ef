"""The engine inside a worker process: its thread, output streams, KV event fan-out and load."""
