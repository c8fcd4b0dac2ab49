"""Our exact engine: the speculative loop, proposers, the token tree, sampling, the target's forward pass and its
fast forms, the models as it loads them (engine.exact.models), the drafting policy and its calibration."""
