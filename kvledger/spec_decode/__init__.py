"""Speculative decoding: proposers that run beside the scheduler (torch-free), the acceptance
rule the runner applies to its verification rows, the adaptive gate and the counters."""
