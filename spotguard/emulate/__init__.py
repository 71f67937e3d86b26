"""Local metadata-service emulators for rehearsals and tests (``spotguard emulate aws|gcp|azure``).

``registry`` knows the providers (start, serve or build one by name); ``common`` is what they share.
"""
