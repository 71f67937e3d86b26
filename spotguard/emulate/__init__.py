"""Local metadata-service emulators for rehearsals and tests (``spotguard emulate aws|gcp|azure``)."""

from spotguard.emulate.common import RunningEmulator, run_emulator_forever, start_emulator

__all__ = ["RunningEmulator", "run_emulator_forever", "start_emulator"]
