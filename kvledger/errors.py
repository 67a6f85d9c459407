"""User-facing errors: anything a caller can cause by bad input raises a subclass of KVLedgerError.

The CLI and the HTTP server turn these into one-line messages / 400 responses; anything else
is a bug and may surface as a traceback.
"""


class KVLedgerError(Exception):
    """Base class for errors caused by the caller's input or configuration."""


class ConfigError(KVLedgerError, ValueError):
    """An invalid engine, model or planning configuration."""


class InvalidRequestError(KVLedgerError, ValueError):
    """A request that can never be served as given (bad parameters, too long, bad token ids)."""


class UnsupportedArchitectureError(ConfigError):
    """A model folder whose architecture kvledger does not implement."""


class CacheError(KVLedgerError, RuntimeError):
    """A block-manager operation that cannot be satisfied; the manager's state is unchanged."""


class OutOfBlocksError(CacheError):
    """The block pool has too few free blocks for the operation."""


class EngineDeadError(RuntimeError):
    """The engine stopped (shutdown, a bug in a step, its process died); no request can
    proceed. Not the caller's fault: the server answers 503."""


class EngineFailedError(EngineDeadError):
    """The engine can take no more steps (a tensor-parallel rank died, hung or failed); every
    in-flight request was aborted. Not the caller's fault: servers answer 503."""
