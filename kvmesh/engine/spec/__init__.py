"""Speculative decoding: proposers (n-gram, EAGLE) suggest draft tokens; decode verifies them
in one forward pass and keeps the longest prefix the target model agrees with."""
