"""Local metadata-service emulators for rehearsals and tests."""
