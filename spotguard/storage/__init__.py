"""Object stores behind one Protocol, chosen by URL scheme.

The SDK backends (boto3, google-cloud-storage) are imported only when a URL
of theirs is opened, so the trainer hook stays free of them unless it must
read a bucket itself.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from spotguard.storage.base import (
    ChecksumMismatch,
    ObjectExists,
    ObjectInfo,
    ObjectNotFound,
    Storage,
    StorageError,
    TransientStorageError,
    check_bucket_url,
)

__all__ = [
    "ChecksumMismatch",
    "ObjectExists",
    "ObjectInfo",
    "ObjectNotFound",
    "Storage",
    "StorageError",
    "TransientStorageError",
    "check_bucket_url",
    "open_storage",
]


def open_storage(url: str, **options: Any) -> Storage:
    scheme = urlparse(url).scheme
    if scheme == "file":
        from spotguard.storage.file import FileStorage

        return FileStorage(url)
    if scheme == "s3":
        from spotguard.storage.s3 import S3Storage

        return S3Storage(url, **options)
    if scheme == "gs":
        from spotguard.storage.gcs import GcsStorage

        return GcsStorage(url, **options)
    raise ValueError(f"{url!r}: unknown scheme; use s3://, gs:// or file://")
