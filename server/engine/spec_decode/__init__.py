"""Speculative decoding: cheap proposals for a sequence's next tokens, checked by the model in one step.

::

    propose (NgramProposer)          seq: ... a b c d | a b c      proposals: [d, a, b]
    schedule (Scheduler)             one chunk [c d a b]: 1 + k slots from the block manager
    verify (the model, one forward)  logits after c, d, a, b
    accept (worker: spec_verify)     target says d, a, x  ->  d, a accepted, x emitted
    settle (SpecDecoder.apply)       c d a computed; slots past the tokens freed

Greedy output is the same as without proposals; sampled output follows the model's own
distribution (rejection sampling, Leviathan et al. 2023, Chen et al. 2023).
"""
