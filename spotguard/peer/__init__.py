"""The peer tier: a daemon with a notice hands its urgent checkpoint to another daemon of the job,
which verifies it and commits it in the shared bucket; a fresh VM may fetch it back to resume.

It sits below the daemon: it takes plain values (addresses, a token, a ``Storage``) and imports
nothing from ``spotguard.config`` nor ``spotguard.daemon``.

- :mod:`~spotguard.peer.wire`: frames, the token, the receiving end of a connection.
- :mod:`~spotguard.peer.noise`: the Noise NNpsk0 handshake and ciphers.
- :mod:`~spotguard.peer.handshake`: a connection's start (docs/peer-protocol.md): greeting, handshake.
- :mod:`~spotguard.peer.records`: the records every byte goes in after it: layout, sealing, opening.
- :mod:`~spotguard.peer.channel`: the protected byte stream of records, with its deadlines.
- :mod:`~spotguard.peer.workers`, :mod:`~spotguard.peer.sockio`: a data frame's bytes carried by a worker process.
- :mod:`~spotguard.peer.files`: received ranges written and checked against a manifest (both sides).
- :mod:`~spotguard.peer.replicas`: a receiver's replicas, their lifecycle and their commit in the bucket.
- :mod:`~spotguard.peer.receiver`: the listening side's connection protocol.
- :mod:`~spotguard.peer.client`: the sending side's connection, and choosing a peer.
- :mod:`~spotguard.peer.handoff`: handing the urgent checkpoint over on a notice.
- :mod:`~spotguard.peer.fetch`: resuming from a replica a peer holds.
- :mod:`~spotguard.peer.discovery`: finding the job's peers through the bucket.
"""
