"""A stand-in for Mooncake's package: on PYTHONPATH first, it makes code
written against `mooncake.engine` run on GuardedTransferEngine unchanged."""
