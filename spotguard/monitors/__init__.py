"""Notice sources: one module per cloud, one Protocol (:class:`spotguard.monitors.base.Monitor`)."""
