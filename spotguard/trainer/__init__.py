"""The trainer side: :class:`spotguard.Guard` and what it needs. Pulls in no daemon dependencies."""
