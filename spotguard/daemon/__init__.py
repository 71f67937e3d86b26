"""The daemon side. Imports aiohttp and storage SDKs; never torch."""
