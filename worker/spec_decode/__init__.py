"""Speculative decoding, the worker's half: draft proposers (n-gram lookup, a draft model) and the
rejection sampler that verifies drafts against the target model (see spec_decoder.py)."""
