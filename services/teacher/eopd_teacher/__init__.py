"""eopd teacher service: exact next-token statistics of a teacher LM over gRPC."""

from eopd_common import __version__

__all__ = ["__version__"]
