"""The clouds: one module per provider (detection, monitors, the doctor's probe, its emulator).

:mod:`~spotguard.providers.base` is the contract (``Monitor``, ``Provider``, ``MonitorSettings``),
:mod:`~spotguard.providers.registry` knows the providers by name, :mod:`~spotguard.providers.detect`
reads DMI. See ``docs/architecture.md`` for adding a cloud.
"""
