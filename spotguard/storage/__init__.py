"""Object stores behind one Protocol, chosen by URL scheme (``spotguard.storage.schemes``).

The SDK backends (boto3, google-cloud-storage) are imported only when a URL
of theirs is opened, so the trainer hook stays free of them unless it must
read a bucket itself.
"""

from __future__ import annotations

from spotguard.storage.base import (
    Capability,
    ChecksumMismatch,
    ObjectExists,
    ObjectInfo,
    ObjectNotFound,
    Storage,
    StorageError,
    StoreDefaults,
    TransientStorageError,
)
from spotguard.storage.schemes import Scheme, check_bucket_url, open_storage, register, scheme_of, unregister

__all__ = [
    "Capability",
    "ChecksumMismatch",
    "ObjectExists",
    "ObjectInfo",
    "ObjectNotFound",
    "Scheme",
    "Storage",
    "StorageError",
    "StoreDefaults",
    "TransientStorageError",
    "check_bucket_url",
    "open_storage",
    "register",
    "scheme_of",
    "unregister",
]
