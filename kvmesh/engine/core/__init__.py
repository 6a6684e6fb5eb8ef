"""The engine itself: requests in, a step scheduled and run, tokens out; its sequences, step plan, outputs, hand-overs, listeners and fault injection."""
