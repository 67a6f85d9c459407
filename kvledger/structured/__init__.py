"""Structured outputs: constrained decoding on xgrammar (JSON schema, regex, choice, EBNF).

params    StructuredOutputsParams, checked when the request is made
compiler  grammar compilation in a background thread, cached by the constraint
state     the per-request matcher and the step's packed token bitmask
"""

from kvledger.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
