"""Local metadata-service emulators for rehearsals and tests (``spotguard emulate aws|gcp|azure``).

Each provider (:mod:`spotguard.providers`) names its emulator; ``registry`` starts, serves or builds one
by provider name; ``common`` is what the emulators share.
"""
