"""Our exact engine, in process: the speculative loop, proposers, the token tree, sampling, the target's
forward pass and its fast forms, the drafting policy."""
